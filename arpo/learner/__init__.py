"""The learner side: group assembly with replay of successes, the loss, the training step."""

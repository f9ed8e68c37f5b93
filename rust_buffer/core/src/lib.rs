//! arpo-buffer: the replay store keyed by task (work in progress).

"""Supervised warm start and the paper's offline baselines, on stored trajectories.

    arpo sft families='["click_button"]' model=runs/tiny out=runs/sft      # oracle demos + NLL
    arpo offline --algo dpo data=runs/collect-base model=runs/sft out=runs/dpo

- `demos`: oracle demonstrations through the real episode path; greedy evaluation;
- `data`: trajectory folders (journal records), success / failure split, DPO pairing;
- `losses`: DPO (sigmoid, IPO, label smoothing), KTO, NLL;
- `offline`: `OfflineConfig`, `OfflineTrainer` (dpo, kto, rft) and `arpo offline`;
- `sft`: `SFTConfig` and `arpo sft`.
"""

"""Training a draft head for a bundle's target (`specedge train-draft`): self-distilled data
(`data.py`, prompts written for it in `prompts.py` and documentation text on the machine) and the
EAGLE-3-style training loop (`train.py`), which writes the head into the bundle atomically."""

"""The learning side: the drafter trainer on the reward stream (installed as `specrl.trainer`).

It meets the server only through Redis (events in), the weights store (checkpoints out) and
HTTP (swap requests): it never imports `specrl.serving`.
"""

"""``python -m trainer.cli``: the ``dflash-train`` command (how torchrun starts a rank)."""

from trainer.cli import main

main()

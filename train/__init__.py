"""The loop's last stage (paper 2.2.3): train the next model on the night's training tables and register it.

`train.stage` hands the night's exported tables to the configured trainer command and records the checkpoint
it wrote in the `checkpoints` table; `train.builtin` is the default trainer, a small full fine-tune of the
embedded model with TRL on the CPU, so the loop closes on a laptop.
"""

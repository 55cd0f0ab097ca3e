"""`python -m hype.train ...` is `hype train ...`; handy as `torchrun --nproc_per_node N -m hype.train`."""

from hype.cli.train import train

if __name__ == "__main__":
    train(prog_name="hype train")

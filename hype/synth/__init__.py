"""The synthetic world: procedural images with captions at known specificity, labelled noise, and
evaluation tasks in DataComp's layout, so that every stage can be tested and benchmarked offline.

Entry point: `make_world(out, size, seed)` (CLI: `hype synth`). Module map:
`scenes` attributes and scene sampling, `render` PIL drawing and encoders, `captions` text at levels 0..4,
`noise` noise kinds and proportions, `pool` planning the pool and clean set, `eval_tasks` evaluation
tasks and the reference set, `rng` named random streams, `shards` deterministic writers, `world` the
orchestration.
"""

from hype.synth.noise import DEFAULT_NOISE, NOISE_KINDS
from hype.synth.world import DEFAULT_BASE_URL, FORMAT_VERSION, SynthError, make_world

__all__ = ["DEFAULT_BASE_URL", "DEFAULT_NOISE", "FORMAT_VERSION", "NOISE_KINDS", "SynthError", "make_world"]

"""HYPE: hyperbolic entailment filtering for image-text data curation."""

__version__ = "0.1.0"

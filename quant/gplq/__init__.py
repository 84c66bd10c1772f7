"""GPLQ: activation-only QAT (LSQ + PCA feature mimicking), then weight PTQ with QwT compensation
(see quant/README.md)."""

"""Post-training quantization by calibration alone: percentile PTQ and RepQ-ViT (see quant/README.md)."""

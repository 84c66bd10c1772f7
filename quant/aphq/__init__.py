"""APHQ-ViT: output-MSE calibration search and block reconstruction with the average perturbation Hessian
(see quant/README.md)."""

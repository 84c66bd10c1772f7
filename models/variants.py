"""Small model variants for the CPU demo and tests, as timm architectures with constructor overrides.

A variant is a timm architecture name plus keyword arguments, so a variant is a real timm
VisionTransformer / SwinTransformer: pair discovery, quantization and weight loading see exactly the
modules and parameter names of the full-size models. The full-size models are timm names as they are
(`vit_base_patch16_224`, `deit_small_patch16_224`, `swin_tiny_patch4_window7_224`, ...).
"""

VARIANTS: dict[str, dict] = {
    # 6-block ViT on 32-pixel inputs (8x8 patches of 4 pixels + cls): the digits demo (~97% top-1).
    "vit_micro": dict(arch="vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=96, depth=6,
                      num_heads=3),
    # Swin with three stages on 32-pixel inputs: 16x16 tokens, windows of 4, two patch mergings.
    "swin_micro": dict(arch="swin_tiny_patch4_window7_224", img_size=32, patch_size=2, window_size=4,
                       embed_dim=48, depths=(2, 2, 2), num_heads=(2, 4, 8)),
    # Two-block models for fast tests.
    "vit_nano": dict(arch="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                     num_heads=2),
    "swin_nano": dict(arch="swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                      embed_dim=32, depths=(1, 1), num_heads=(2, 4)),
}

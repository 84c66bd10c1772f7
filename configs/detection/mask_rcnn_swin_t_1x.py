"""Mask R-CNN with a Swin-T backbone, 1x schedule (12 epochs), fp16 AMP: the paper's "Swin-T 1x" (Table 2).

MMDetection 3.3's official config, with fp16 AMP as the paper trains every model (MMDetection ships this
schedule in fp32 only; its 3x AMP variant switches AMP on the same way: `AmpOptimWrapper`), and the backbone
initialisation: the official Swin-T ImageNet checkpoint is a local file the user names (nothing is
downloaded), e.g.

    model.backbone.init_cfg.checkpoint=/weights/swin_tiny_patch4_window7_224.pth

Add a method with a second --config (configs/detection/method/{cd,tweo,noise}.py); see docs/reproduce.md.
"""
_base_ = "mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py"
model = dict(backbone=dict(init_cfg=dict(type="Pretrained", checkpoint=None)))
optim_wrapper = dict(type="AmpOptimWrapper")  # the official 3x AMP config's one change; dynamic loss scale

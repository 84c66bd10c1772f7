"""Mask R-CNN with a Swin-T backbone, 1x schedule (12 epochs): the paper's "Swin-T 1x" (Table 2).

MMDetection 3.3's official config, unchanged but for the backbone initialisation: the official Swin-T
ImageNet checkpoint is a local file the user names (nothing is downloaded), e.g.

    model.backbone.init_cfg.checkpoint=/weights/swin_tiny_patch4_window7_224.pth

Add a method with a second --config (configs/detection/method/{cd,tweo,noise}.py); see docs/reproduce.md.
"""
_base_ = "mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py"
model = dict(backbone=dict(init_cfg=dict(type="Pretrained", checkpoint=None)))

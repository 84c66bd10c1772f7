"""Mask R-CNN with a Swin-S backbone, 3x schedule (36 epochs, multi-scale crop training, fp16 AMP): the
paper's "Swin-S 3x" (Table 2).

MMDetection 3.3's official config, unchanged but for the backbone initialisation: the official Swin-S
ImageNet checkpoint is a local file the user names (nothing is downloaded), e.g.

    model.backbone.init_cfg.checkpoint=/weights/swin_small_patch4_window7_224.pth
"""
_base_ = "mmdet::swin/mask-rcnn_swin-s-p4-w7_fpn_amp-ms-crop-3x_coco.py"
model = dict(backbone=dict(init_cfg=dict(type="Pretrained", checkpoint=None)))

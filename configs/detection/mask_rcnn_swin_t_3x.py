"""Mask R-CNN with a Swin-T backbone, 3x schedule (36 epochs, multi-scale crop training, fp16 AMP): the
paper's "Swin-T 3x" (Table 2).

MMDetection 3.3's official AMP config (the paper trains with AMP; MMDetection also ships an fp32 variant,
`mask-rcnn_swin-t-p4-w7_fpn_ms-crop-3x_coco.py`), unchanged but for the backbone initialisation: the official
Swin-T ImageNet checkpoint is a local file the user names (nothing is downloaded), e.g.

    model.backbone.init_cfg.checkpoint=/weights/swin_tiny_patch4_window7_224.pth
"""
_base_ = "mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_amp-ms-crop-3x_coco.py"
model = dict(backbone=dict(init_cfg=dict(type="Pretrained", checkpoint=None)))

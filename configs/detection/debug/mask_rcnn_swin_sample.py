"""A tiny Mask R-CNN + Swin on the generated COCO-format sample (data/coco_sample.py): the paper's detection
configs at toy size, for the CPU tests and smoke runs of training, CD / TWEO / Noise and the quantized
evaluation. Same model types and heads as configs/detection/mask_rcnn_swin_t_1x.py; only sizes change.

    python scripts/make_coco_sample.py /tmp/coco_sample
    python scripts/train_detection.py --config configs/detection/debug/mask_rcnn_swin_sample.py \
        --data-root /tmp/coco_sample --work-dir runs/det_sample

`rcnn.score_thr=0` keeps the top 100 boxes per image even for a barely trained model, so that the mask head
always runs (calibration needs every quantizer to see data) and mAP is defined.
"""
_base_ = "../mask_rcnn_swin_t_1x.py"

size = 64
classes = ("box", "disc")
dims = 16
model = dict(
    data_preprocessor=dict(pad_size_divisor=32),
    backbone=dict(embed_dims=dims, depths=[1, 1, 1, 1], num_heads=[1, 2, 2, 4], window_size=7,
                  drop_path_rate=0.0, pretrain_img_size=size, init_cfg=None),
    neck=dict(in_channels=[dims, 2 * dims, 4 * dims, 8 * dims], out_channels=32),
    rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=32),
        bbox_head=dict(in_channels=32, fc_out_channels=64, num_classes=len(classes)),
        mask_roi_extractor=dict(out_channels=32),
        mask_head=dict(num_convs=2, in_channels=32, conv_out_channels=32, num_classes=len(classes))),
    test_cfg=dict(rcnn=dict(score_thr=0.0)))

metainfo = dict(classes=classes)
train_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="LoadAnnotations", with_bbox=True, with_mask=True),
    dict(type="Resize", scale=(size, size), keep_ratio=True),
    dict(type="RandomFlip", prob=0.5),
    dict(type="PackDetInputs"),
]
test_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="Resize", scale=(size, size), keep_ratio=True),
    dict(type="LoadAnnotations", with_bbox=True, with_mask=True),
    dict(type="PackDetInputs", meta_keys=("img_id", "img_path", "ori_shape", "img_shape", "scale_factor")),
]
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(metainfo=metainfo, pipeline=train_pipeline, filter_cfg=dict(min_size=8)))
val_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                      dataset=dict(metainfo=metainfo, pipeline=test_pipeline))
test_dataloader = val_dataloader

max_epochs = 2
train_cfg = dict(max_epochs=max_epochs, val_interval=1)
param_scheduler = [dict(type="LinearLR", start_factor=0.1, by_epoch=False, begin=0, end=4)]
# fp32: MMEngine's AMP wrapper needs a GPU, and the tests run on CPUs
optim_wrapper = dict(type="OptimWrapper", optimizer=dict(lr=1e-3))
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=1))

"""Colinearity Decay on the detector's backbone (paper Sec. "COCO Detection"), an MMEngine config fragment to merge
on top of an MMDetection config (Mask R-CNN + Swin; AdamW, weight decay 0.05).

lam = 0.005 and the regularization-budget rule (App. A.2: weight decay 0.05 - lam = 0.045) are our choices: the
paper gives no detection strengths, so these are its pre-training ones (one tenth of the weight decay). Give it as
a later --config of scripts/train_detection.py or evaluate_detection.py: they merge it over the earlier files, add
its hook to theirs (engine/detection/config.py `merge_fragment`: with tweo.py or noise.py both hooks run) and apply
`cd_budget` once files and overrides are merged (`cd.integrations.mmengine.apply_weight_decay_budget`): the weight
decay the config then holds, minus the hook's lam, so `custom_hooks.0.lam=0.01` gives 0.04 and
`optim_wrapper.optimizer.weight_decay=0.1` gives 0.095; `cd_budget=False` keeps the weight decay as given. The rule
lowers the optimizer's one weight decay, so the neck and heads, which CD does not decay, train at 0.045 as well;
a paramwise_cfg decay_mult of 0.05 / 0.045 on them keeps theirs (cd/README.md).
Elsewhere merge it with `engine.detection.merge_fragment(cfg, Config.fromfile("configs/detection/method/cd.py")
.to_dict())`, or list the MMDetection config as `_base_` of a child that holds these lines, then call
`apply_weight_decay_budget(cfg)`: MMEngine alone reads `cd_budget` as an unused variable.
"""
custom_imports = dict(imports=["cd.integrations.mmengine"], allow_failed_imports=False)
custom_hooks = [dict(type="ColinearityDecayHook", lam=0.005)]
cd_budget = True  # weight decay -> weight decay - lam: cd.integrations.mmengine.apply_weight_decay_budget

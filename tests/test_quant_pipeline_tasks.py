"""A pipeline quantizes the models of its tasks (`Pipeline.tasks`: engine/tasks.py names, and detection). Called
through the Python API on another task's model, it refuses with one ValueError naming that task's pipelines, before
any work: no data drawn, nothing copied or converted (APHQ on a GPT used to draw its images and fail in the GPT's
token embedding; RepQ-ViT and percentile ran on it, though evaluate.py refuses them for a language model)."""
import pytest
import torch

from configs.quant import APHQOptions
from models.gpt import GPT
from quant import PIPELINES
from quant.pipeline_data import PipelineData
from quant_models import images, tiny_vit

# the paper's language-model pipelines (Table 8) and the image pipelines that also take a detector
LM_PIPELINES = ["gptq", "rtn", "smoothquant", "smoothquant_strict"]
DETECTOR_PIPELINES = ["aphq", "gplq", "percentile", "repq"]


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=50, context=16, depth=2, num_heads=2, embed_dim=32).eval()


@pytest.mark.parametrize("pipeline", sorted(set(PIPELINES) - set(LM_PIPELINES)))
def test_an_image_pipeline_refuses_a_gpt_before_any_work(pipeline, monkeypatch):
    drawn = []
    data = PipelineData(train_images=lambda *args: drawn.append(args) or images(16),
                        train_loader=lambda *args: drawn.append(args))
    monkeypatch.setattr(type(PIPELINES[pipeline]), "run", lambda *a, **k: pytest.fail("run reached"))
    with pytest.raises(ValueError, match=rf"^{pipeline} quantizes classification and detection models, not a "
                                         rf"causal_lm model \(GPT\); the causal_lm pipelines are "
                                         rf"{', '.join(LM_PIPELINES)}$"):
        PIPELINES[pipeline](gpt(), torch.randint(0, 50, (4, 16)), "w4a4", data=data)
    assert drawn == []


def test_aphq_on_a_gpt_is_refused_before_its_data_is_drawn():
    """Without the monkeypatched run: the refusal comes from __call__ itself, not from the GPT's embedding."""
    drawn = []
    data = PipelineData(train_images=lambda *args: drawn.append(args) or images(16))
    with pytest.raises(ValueError, match=r"^aphq quantizes classification and detection models"):
        PIPELINES["aphq"](gpt(), None, "w4a4", APHQOptions(iters=0, calib_images=8, eq_n=32), data=data)
    assert drawn == []


@pytest.mark.parametrize("pipeline", LM_PIPELINES)
def test_the_lm_pipelines_take_a_gpt_and_an_image_classifier(pipeline):
    PIPELINES[pipeline].check_task(gpt(), detection=False)
    PIPELINES[pipeline].check_task(tiny_vit(), detection=False)


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_a_detector_is_taken_by_the_detector_pipelines_alone(pipeline):
    """A detector is the model of a run whose data holds detector_samples (evaluate_detection.py)."""
    if pipeline in DETECTOR_PIPELINES:
        PIPELINES[pipeline].check_task(tiny_vit(), detection=True)
    else:
        with pytest.raises(ValueError, match=rf"^{pipeline} quantizes classification and causal_lm models, not a "
                                             rf"detection model .*; the detection pipelines are "
                                             rf"{', '.join(DETECTOR_PIPELINES)}$"):
            PIPELINES[pipeline].check_task(tiny_vit(), detection=True)

"""The training loop hands the loss the labels mixed as its images are (DeiT's mixup): the mixing weight is
recovered from the images alone (least squares against the raw batch and its reverse, timm's "batch" mode) and the
targets must be that mix of the (smoothed) one-hot labels, written out here rather than read from timm. Checks on
the Mixup object's settings, or the soft-target criterion alone, pass with a loop that mixes the images and scores
them against plain one-hot labels."""
import pytest
import torch
from timm.data import Mixup

from engine.loop import TrainBatches, TrainLoop, TrainState
from tests.test_train import _FixedOrder


def one_hot(labels: torch.Tensor, classes: int, smoothing: float) -> torch.Tensor:
    """Label-smoothed one-hot rows: 1 - smoothing + smoothing / classes on the label, smoothing / classes off it."""
    off = smoothing / classes
    rows = torch.full((len(labels), classes), off)
    rows[torch.arange(len(labels)), labels] = 1 - smoothing + off
    return rows


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_loss_gets_the_labels_mixed_with_the_images_weight(smoothing):
    classes = 5
    images = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    seen = []

    def compute_loss(model, x, y):
        seen.append((x.detach().clone(), y.detach().clone()))
        return model(x).sum()

    model = torch.nn.Linear(3, classes)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=0.0, prob=1.0, label_smoothing=smoothing, num_classes=classes)
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), compute_loss=compute_loss,
                     device=torch.device("cpu"), mixup=mixup, log_every=100)
    loop.run_epoch(TrainBatches([(images.clone(), labels.clone())], _FixedOrder()), TrainState(),
                   batch_size_per_gpu=8)
    (mixed, targets), = seen
    # mixed = lam * x + (1 - lam) * x.flip(0): lam from the images by least squares
    own, other = images - images.flip(0), mixed - images.flip(0)
    lam = float((own * other).sum() / (own * own).sum())
    # the loop's seeded draw mixes (lam = 1 would leave the labels as they are and check nothing)
    assert 0.0 <= lam < 0.99 and torch.allclose(mixed, lam * images + (1 - lam) * images.flip(0), atol=1e-5)
    expected = lam * one_hot(labels, classes, smoothing) + (1 - lam) * one_hot(labels.flip(0), classes, smoothing)
    assert torch.allclose(targets, expected, atol=1e-5), (targets, expected)

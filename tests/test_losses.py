"""The stage-two losses and C2KD modules against hand-written references and analytic cases."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from c2kd.errors import C2KDError
from c2kd.recmodel.prompts import answer_index, answer_mask
from c2kd.student.cross_head import CrossHead
from c2kd.student.filters import LayerFilters
from c2kd.student.layer_map import uniform_layer_map
from c2kd.student.router import parse_router, route, routed_feature_loss, router_scores
from c2kd.student.losses import cross_head_kd_loss, feature_loss, logit_kd_loss, orth_loss


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _pad_tokens(x: torch.Tensor, extra: int, fill: float = 7.0) -> torch.Tensor:
    """Append `extra` junk positions along dim 1."""
    junk = torch.full((x.shape[0], extra, *x.shape[2:]), fill, dtype=x.dtype)
    return torch.cat([x, junk], dim=1)


# ---------------------------------------------------------------- answer positions


def test_answer_mask_marks_positions_that_predict_answer_tokens():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 3, -100, -100, -100]])
    expected = torch.tensor([[False, True, True, False, False], [True, False, False, False, False]])
    assert torch.equal(answer_mask(labels), expected)
    positions, mask = answer_index(labels)
    assert positions.tolist() == [[1, 2], [0, 0]] and mask.tolist() == [[True, True], [True, False]]


# ---------------------------------------------------------------- feature loss


def _authors_feature_loss(h_s: torch.Tensor, h_t: torch.Tensor) -> torch.Tensor:
    """The authors' form without padding: unit rows, elementwise MSE, cosine of the flattened tensors."""
    s = h_s / h_s.norm(dim=-1, keepdim=True)
    t = h_t / h_t.norm(dim=-1, keepdim=True)
    mse = ((s - t) ** 2).mean()
    cos = (s.flatten() @ t.flatten()) / (s.flatten().norm() * t.flatten().norm())
    return 0.5 * mse + 0.5 * (1 - cos)


def test_feature_loss_matches_authors_form_when_nothing_is_padded():
    h_s, h_t = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert torch.allclose(feature_loss(h_s, h_t, mask), _authors_feature_loss(h_s, h_t), atol=1e-6)


def test_feature_loss_analytic_cases():
    h = torch.randn(2, 3, 8)
    mask = torch.ones(2, 3, dtype=torch.bool)
    assert feature_loss(h, h, mask).item() == pytest.approx(0.0, abs=1e-6)
    # opposite directions: MSE of unit vectors = 4/d, 1 - cos = 2
    assert feature_loss(h, -h, mask).item() == pytest.approx(0.5 * 4 / 8 + 0.5 * 2, rel=1e-5)
    # scale of either side does not matter (features are L2-normalised)
    h_t = torch.randn(2, 3, 8)
    assert torch.allclose(feature_loss(5 * h, h_t, mask), feature_loss(h, 0.1 * h_t, mask), atol=1e-6)


def test_feature_loss_ignores_padding():
    h_s, h_t = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    base = feature_loss(h_s, h_t, mask)
    padded = feature_loss(_pad_tokens(h_s, 3, 1.0), _pad_tokens(h_t, 3, -1.0), F.pad(mask, (0, 3), value=False))
    assert torch.allclose(base, padded, atol=1e-6)
    # and masked-out positions inside the sequence do not matter either
    h_s2 = h_s.clone()
    h_s2[0, 3] = 100.0
    assert torch.allclose(base, feature_loss(h_s2, h_t, mask), atol=1e-6)
    # the mask does matter: it would fail if it were ignored
    assert not torch.allclose(base, feature_loss(h_s, h_t, torch.ones_like(mask)), atol=1e-4)


def test_feature_loss_example_weights_give_weighted_token_mean():
    h_s, h_t = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    mask = torch.ones(2, 3, dtype=torch.bool)
    w = torch.tensor([1.0, 0.0])
    only_first = feature_loss(h_s[:1], h_t[:1], mask[:1])
    assert torch.allclose(feature_loss(h_s, h_t, mask, example_weight=w), only_first / 2, atol=1e-6)


def test_feature_loss_with_empty_mask_is_zero_and_differentiable():
    h_s = torch.randn(2, 3, 8, requires_grad=True)
    loss = feature_loss(h_s, torch.randn(2, 3, 8), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and h_s.grad is not None


# ---------------------------------------------------------------- logit losses


def _manual_soft_ce(z_s, z_t, tau):
    p = torch.softmax(z_t / tau, dim=-1)
    return -(p * torch.log_softmax(z_s / tau, dim=-1)).sum(-1)


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_cross_head_kd_matches_manual_soft_cross_entropy(tau):
    z_s, z_t = torch.randn(2, 4, 13), torch.randn(2, 4, 13)
    mask = torch.tensor([[True, False, True, True], [False, True, False, False]])
    ref = _manual_soft_ce(z_s, z_t, tau)[mask].mean()  # no tau^2 factor
    assert torch.allclose(cross_head_kd_loss(z_s, z_t, mask, tau=tau), ref, atol=1e-6)


def test_cross_head_kd_with_one_hot_teacher_is_plain_cross_entropy():
    z_s = torch.randn(6, 13)
    target = torch.randint(0, 13, (6,))
    z_t = torch.full((6, 13), float("-inf"))
    z_t[torch.arange(6), target] = 0.0  # a top-1 cache: all other logits unknown
    loss = cross_head_kd_loss(z_s, z_t, None)
    assert torch.isfinite(loss)
    assert torch.allclose(loss, F.cross_entropy(z_s, target), atol=1e-6)


def test_cross_head_kd_ignores_padding():
    z_s, z_t = torch.randn(2, 4, 13), torch.randn(2, 4, 13)
    mask = torch.tensor([[True, False, True, True], [False, True, False, False]])
    padded = cross_head_kd_loss(_pad_tokens(z_s, 2), _pad_tokens(z_t, 2, -3.0), F.pad(mask, (0, 2), value=False))
    assert torch.allclose(cross_head_kd_loss(z_s, z_t, mask), padded, atol=1e-6)


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_logit_kd_is_tau_squared_kl(tau):
    z_s, z_t = torch.randn(5, 13), torch.randn(5, 13)
    ref = F.kl_div(F.log_softmax(z_s / tau, -1), F.log_softmax(z_t / tau, -1), log_target=True, reduction="batchmean")
    assert torch.allclose(logit_kd_loss(z_s, z_t, None, tau=tau), tau**2 * ref, atol=1e-6)
    assert logit_kd_loss(z_t, z_t, None, tau=tau).item() == pytest.approx(0.0, abs=1e-6)


def test_logit_kd_and_cross_head_have_equal_gradients_at_tau_one():
    z_t = torch.randn(5, 13)
    a = torch.randn(5, 13, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    logit_kd_loss(a, z_t, None).backward()
    cross_head_kd_loss(b, z_t, None).backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


# ---------------------------------------------------------------- orthogonality loss


def test_orth_loss_is_zero_for_orthogonal_square_matrix():
    q, _ = torch.linalg.qr(torch.randn(16, 16))
    assert orth_loss(q).item() == pytest.approx(0.0, abs=1e-6)
    # scaling rows changes nothing (rows are normalised first)
    assert orth_loss(q * torch.arange(1, 17).unsqueeze(1)).item() == pytest.approx(0.0, abs=1e-6)


def test_orth_loss_analytic_case_uses_frobenius_not_squared():
    w = torch.tensor([[1.0, 0.0], [2.0, 0.0]])  # rows normalise to (1, 0) twice
    # ŴŴᵀ - I = [[0,1],[1,0]] -> sqrt(2);  ŴᵀŴ - I = [[1,0],[0,-1]] -> sqrt(2);  numel = 4
    assert orth_loss(w).item() == pytest.approx(2 * math.sqrt(2) / 4, rel=1e-5)


def test_orth_loss_rectangular_matches_reference():
    w = torch.randn(6, 3)
    w_hat = w / w.norm(dim=1, keepdim=True)
    ref = (torch.dist(w_hat @ w_hat.T, torch.eye(6)) + torch.dist(w_hat.T @ w_hat, torch.eye(3))) / w.numel()
    assert torch.allclose(orth_loss(w), ref, atol=1e-6)


# ---------------------------------------------------------------- layer filters (stage 1)


def test_stage1_loss_is_sum_of_per_layer_cross_entropies():
    filters = LayerFilters([2, 4], d_t=12, d_s=6, classes=9)
    hidden = {2: torch.randn(5, 12), 4: torch.randn(5, 12)}
    labels = torch.randint(0, 9, (5,))
    ref = sum(
        F.cross_entropy(filters.head(filters.norm(hidden[l] @ filters.filters[str(l)].weight.T)), labels) for l in (2, 4)
    )
    assert torch.allclose(torch.stack(list(filters(hidden, labels).values())).sum(), ref, atol=1e-6)


def test_stage1_gradients_reach_every_filter_the_norm_and_the_head():
    filters = LayerFilters([2, 4], d_t=12, d_s=6, classes=9)
    hidden = {l: torch.randn(5, 12) for l in (2, 4)}  # cached teacher states: plain data
    torch.stack(list(filters(hidden, torch.randint(0, 9, (5,))).values())).sum().backward()
    names = {n for n, p in filters.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert names == {"filters.2.weight", "filters.4.weight", "norm.weight", "head.weight"}


def test_layer_filters_refuse_missing_layers():
    filters = LayerFilters([2, 4], d_t=12, d_s=6, classes=9)
    with pytest.raises(C2KDError, match=r"\[4\]"):
        filters.project({2: torch.randn(3, 12)})


# ---------------------------------------------------------------- router


def _router_case():
    student = torch.randn(3, 5, 6)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[2, 3:] = False
    # layer 4 is the student plus small noise for examples 0 and 2; layer 6 for example 1
    projected = {l: torch.randn(3, 5, 6) for l in (2, 4, 6)}
    projected[4][[0, 2]] = student[[0, 2]] + 0.05 * torch.randn(2, 5, 6)
    projected[6][1] = 3.0 * student[1]  # a scaled copy: cosine 1
    return student, projected, mask


def test_router_scores_are_sums_of_token_cosines():
    student, projected, mask = _router_case()
    scores = router_scores(student, projected, mask)
    ref = F.cosine_similarity(student[2, :3], projected[2][2, :3], dim=-1).sum()
    assert scores.shape == (3, 3)
    assert torch.allclose(scores[2, 0], ref, atol=1e-5)
    assert scores[1, 2].item() == pytest.approx(5.0, rel=1e-5)


def test_top1_router_picks_the_most_similar_layer():
    student, projected, mask = _router_case()
    routing = route(student, projected, mask, "top1")
    assert routing.chosen.tolist() == [4, 6, 4]
    assert torch.equal(routing.weights, torch.tensor([[0.0, 1, 0], [0, 0, 1], [0, 1, 0]]))
    counts = {k: int(v) for k, v in routing.counts().items()}
    assert counts == {"count/router_layer_2": 0, "count/router_layer_4": 2, "count/router_layer_6": 1}


def test_router_ignores_padding():
    student, projected, mask = _router_case()
    base = route(student, projected, mask, "soft")
    # make the padded tokens of example 2 identical to layer 2: they must not count
    student2 = student.clone()
    student2[2, 3:] = projected[2][2, 3:]
    again = route(student2, projected, mask, "soft")
    assert torch.allclose(base.scores, again.scores, atol=1e-6)


def test_soft_router_is_softmax_over_scores_and_fixed_router_is_one_hot():
    student, projected, mask = _router_case()
    soft = route(student, projected, mask, "soft")
    assert torch.allclose(soft.weights, torch.softmax(soft.scores, dim=-1))
    assert torch.allclose(soft.weights.sum(-1), torch.ones(3))
    assert soft.chosen.tolist() == [4, 6, 4]
    fixed = route(student, projected, mask, "fixed:2")
    assert fixed.chosen.tolist() == [2, 2, 2]
    assert not fixed.weights.requires_grad


def test_router_rejects_bad_modes():
    student, projected, mask = _router_case()
    with pytest.raises(C2KDError, match="fixed:5"):
        route(student, projected, mask, "fixed:5")
    for bad in ("best", "soft:0", "soft:-1", "soft:nan", "soft:x", "fixed:x"):
        with pytest.raises(C2KDError, match="top1, soft, soft:T"):
            parse_router(bad)
    assert parse_router("fixed:30") == ("fixed", 30)
    assert parse_router("soft") == ("soft", 1.0) and parse_router("soft:4") == ("soft", 4.0)
    with pytest.raises(C2KDError, match="no probe scores"):
        route(student, projected, mask, "probe")


def test_soft_router_temperature_flattens_the_weights():
    student, projected, mask = _router_case()
    sharp, flat = route(student, projected, mask, "soft"), route(student, projected, mask, "soft:10")
    assert torch.allclose(flat.weights, torch.softmax(flat.scores / 10, dim=-1))
    assert (flat.weights.max(dim=-1).values < sharp.weights.max(dim=-1).values).all()


def test_probe_router_follows_the_probe_scores_not_the_cosines():
    student, projected, mask = _router_case()
    probe = torch.tensor([[0.0, -1.0, -2.0], [-3.0, -2.0, -1.0], [-0.5, -0.1, -4.0]])  # minus CE per layer
    routing = route(student, projected, mask, "probe", probe_scores=probe)
    assert routing.chosen.tolist() == [2, 6, 4] and routing.one_hot
    assert route(student, projected, mask, "top1").chosen.tolist() == [4, 6, 4]


# ---------------------------------------------------------------- cross-head


def test_cross_head_logits_use_the_teacher_head_and_never_train_it():
    head = CrossHead(d_s=6, d_t=10)
    teacher_head = torch.randn(17, 10, requires_grad=True)  # even if someone forgot to freeze it
    h_s = torch.randn(4, 6, requires_grad=True)
    z = head.logits(h_s, teacher_head)
    assert z.shape == (4, 17)
    assert torch.allclose(z, (h_s @ head.feat_mlp.weight.T + head.feat_mlp.bias) @ teacher_head.T, atol=1e-5)
    z_t = torch.randn(4, 17)
    loss = cross_head_kd_loss(z, z_t, None) + 0.05 * orth_loss(head.feat_mlp.weight)
    loss.backward()
    assert teacher_head.grad is None
    assert head.feat_mlp.weight.grad is not None and head.feat_mlp.bias.grad is not None
    assert h_s.grad is not None and h_s.grad.abs().sum() > 0


# ---------------------------------------------------------------- feature-KD layer map


def test_uniform_layer_map_rule():
    assert uniform_layer_map(2, 6, [2, 3, 4, 5]) == {1: 3}
    assert uniform_layer_map(4, 8, [4, 5, 6, 7]) == {2: 4, 3: 6}
    # the authors' 32 -> 16 setting with late layers cached keeps the pairs that exist
    assert uniform_layer_map(16, 32, [24, 26, 28, 30]) == {12: 24, 13: 26, 14: 28, 15: 30}


def test_uniform_layer_map_names_missing_layers():
    with pytest.raises(C2KDError, match=r"\[2, 4\].*holds \[5, 6\]"):
        uniform_layer_map(3, 6, [5, 6])
    with pytest.raises(C2KDError, match="at least 2 layers"):
        uniform_layer_map(1, 6, [3])


@pytest.mark.parametrize("mode", ["top1", "fixed:3"])
def test_one_hot_routing_computes_one_feature_loss_equal_to_the_weighted_sum(mode):
    h_s = torch.randn(4, 6, 8)
    projected = {l: torch.randn(4, 6, 8) for l in (2, 3, 5)}
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    routing = route(h_s, projected, mask, mode)
    assert routing.one_hot
    weighted = sum(feature_loss(h_s, projected[l], mask, example_weight=routing.weights[:, k])
                   for k, l in enumerate(routing.layers))
    torch.testing.assert_close(routed_feature_loss(h_s, projected, mask, routing), weighted)
    soft = route(h_s, projected, mask, "soft")
    assert not soft.one_hot


def test_a_row_without_any_finite_teacher_logit_gives_no_signal_and_no_nan():
    # a top-k cache read with --kd-over items: none of a row's K cached tokens may be an item
    z_t = torch.tensor([[2.0, -1.0, float("-inf")], [float("-inf")] * 3])
    for loss_fn in (logit_kd_loss, cross_head_kd_loss):
        z_s = torch.randn(2, 3, requires_grad=True)
        loss = loss_fn(z_s, z_t, None)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(z_s.grad).all(), loss_fn.__name__
        assert torch.equal(z_s.grad[1], torch.zeros(3))  # the empty row teaches nothing
        alone = loss_fn(z_s[:1].detach(), z_t[:1], None)
        torch.testing.assert_close(loss, alone / 2)  # it counts as a zero term in the mean

"""Lab 00's warm-up (a send/recv pair) and lab 09's exercise (predict torch DDP's buckets):
correct answers written several ways pass, each planted slip is named; gloo's blocking send
waits for its receiver. Budget: ~40 s (3 ranks for lab 00, 2 for lab 09).
"""

import pytest
import torch
import torch.distributed as dist

from ddplab.checks import CheckFailed, check_pass_right
from ddplab.checks import firstgroup as W
from ddplab.checks import reducer_map as B
from ddplab.lessons import ring

pytestmark = pytest.mark.timeout(300)


# -- lab 09: torch's bucket rule -----------------------------------------------------------------
def rule_by_hand(params, bucket_cap_mb=None, ready_order=None):
    """A learner's version: one open bucket per dtype, add then close at the limit."""
    mib = 1024 * 1024
    limits = [1 * mib, 25 * mib] if bucket_cap_mb is None else [bucket_cap_mb * mib]
    buckets, open_ = [], {}
    for i in (reversed(range(len(params))) if ready_order is None else ready_order):
        p = params[i]
        idx, size, k = open_.get(p.dtype, ([], 0, 0))
        idx, size = idx + [i], size + p.numel() * p.element_size()
        if size >= limits[k]:
            buckets.append(idx)
            idx, size, k = [], 0, min(k + 1, len(limits) - 1)
        open_[p.dtype] = (idx, size, k)
    return buckets + [idx for idx, _, _ in open_.values() if idx]


def rule_with_torch(params, bucket_cap_mb=None, ready_order=None):
    """Another: torch's own helper, given the parameters in gradient-ready order."""
    limits = ([dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2 ** 20] if bucket_cap_mb is None
              else [int(bucket_cap_mb * 2 ** 20)])
    order = list(reversed(range(len(params)))) if ready_order is None else list(ready_order)
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in order], limits, [False] * len(params), order)
    return [list(b) for b in buckets]


def rule_as_tuples(params, bucket_cap_mb=None, ready_order=None):
    """And one returning tuples of numpy-style ints: any sequence of indices is an answer."""
    return tuple(tuple(torch.tensor(b).tolist())
                 for b in rule_by_hand(params, bucket_cap_mb, ready_order))


def rule_open_tail_sorted(params, bucket_cap_mb=None, ready_order=None):
    """And one putting the buckets still open at the end in yet another order (by dtype name):
    torch's order there is its hash map's, so any order passes."""
    closed, still_open = B._walk(params, bucket_cap_mb, ready_order)
    return closed + sorted(still_open, key=lambda b: str(params[b[0]].dtype))


def _params_and_order(case):
    layers, cap, *use = case
    return list(B.case_model(layers, use=use[0] if use else None).parameters()), cap, \
        B.expected_ready_order(case)


def test_the_cases_end_with_several_dtypes_open_and_one_uses_its_layers_out_of_order():
    opens = [len(B._walk(*_params_and_order(c))[1]) for c in B.CASES]
    assert max(opens) >= 3 and sum(n >= 2 for n in opens) >= 2
    orders = [B.expected_ready_order(c) for c in B.CASES]
    assert any(o != list(range(len(o)))[::-1] for o in orders)


def test_every_slip_changes_the_layout_of_some_case():
    for mistake, switches in B.SLIPS.items():
        differs = [c for c in B.CASES
                   if not B.same_buckets(B.layout(*_params_and_order(c), **switches),
                                         *B._as_rule(*_params_and_order(c)))]
        assert differs, mistake


def test_lab09_exercise_2s_cap_is_one_where_the_rule_decides_the_answer():
    """rebuild_on_rank's model at bucket_cap_mb=0.001: torch's rule (add, then close) gives 2
    buckets, closing before the cap would be exceeded gives 4, the default cap 1 (a run on 2
    ranks gave torch's 2 and 1: [[c.bias, c.weight, b.bias, b.weight], [a.bias, a.weight]])."""
    from ddplab.lessons import reducer_map

    params = list(reducer_map._declared_out_of_order().parameters())
    ready = [1, 0, 3, 2, 5, 4]  # c, b, a: the order backward gives (bias, then weight)
    assert B.layout(params, 0.001, ready) == [[1, 0, 3, 2], [5, 4]]
    assert len(B.layout(params, 0.001, ready, close_before=True)) == 4
    assert B.layout(params, None, ready) == [ready]


@pytest.fixture(scope="module")
def live_buckets(session_cluster2):
    session_cluster2.ensure_ready()
    return session_cluster2.run(B.rebuilt_buckets_on_rank, B.CASES)[0]


@pytest.mark.slow
def test_the_rule_predicts_torchs_live_reducer_and_correct_answers_pass(live_buckets):
    for case, (want, ready) in zip(B.CASES, live_buckets):
        params, cap, expected = _params_and_order(case)
        assert ready == expected  # backward's order: the layers used last come first
        assert B.same_buckets(B.layout(params, cap, ready), *B._as_rule(params, cap, ready))
        rule, n_open = B._as_rule(params, cap, ready)
        assert B.same_buckets(rule, want, n_open)
    for fn in (rule_by_hand, rule_with_torch, rule_as_tuples, rule_open_tail_sorted):
        B.judge(fn, live_buckets)


@pytest.mark.slow
@pytest.mark.parametrize("mistake", list(B.SLIPS))
def test_each_slip_is_named(live_buckets, mistake):
    def slipped(params, bucket_cap_mb, ready_order=None):
        return B.layout(params, bucket_cap_mb, ready_order, **B.SLIPS[mistake])
    with pytest.raises(CheckFailed) as err:
        B.judge(slipped, live_buckets)
    assert err.value.mistake == mistake


@pytest.mark.slow
def test_a_stub_a_crash_and_a_non_answer_are_verdicts_in_words(live_buckets):
    def stub(params, bucket_cap_mb, ready_order=None):
        raise NotImplementedError

    def crash(params, bucket_cap_mb, ready_order=None):
        return params[99]

    for fn, mistake in ((stub, "not implemented yet"), (crash, "your code raised an exception"),
                        (lambda params, cap, ready_order: None, B.NOT_BUCKETS),
                        (lambda params, cap, ready_order: [list(range(len(params)))],
                         B.WRONG_LAYOUT)):
        with pytest.raises(CheckFailed) as err:
            B.judge(fn, live_buckets)
        assert err.value.mistake == mistake


# -- lab 00: the warm-up pair, and what a blocking send waits for --------------------------------
def pass_isend_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    req = dist.isend(t, (rank + 1) % p)
    dist.recv(buf, (rank - 1) % p)
    req.wait()
    return buf


def pass_even_odd(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    if rank % 2 == 0:
        dist.send(t, (rank + 1) % p)
        dist.recv(buf, (rank - 1) % p)
    else:
        dist.recv(buf, (rank - 1) % p)
        dist.send(t, (rank + 1) % p)
    return buf


def pass_irecv_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros_like(t)
    req = dist.irecv(buf, (rank - 1) % p)
    dist.send(t, (rank + 1) % p)
    req.wait()
    return buf


def everyone_sends_first(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    dist.send(t, (rank + 1) % p)
    dist.recv(buf, (rank - 1) % p)
    return buf


def from_the_right(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    req = dist.isend(t, (rank - 1) % p)
    dist.recv(buf, (rank + 1) % p)
    req.wait()
    return buf


def returns_nothing(t):
    pass_isend_first(t)


@pytest.fixture
def three(cluster3):
    return cluster3  # shared for the session (conftest.py)


@pytest.mark.slow
def test_warm_up_passes_written_three_ways(three):
    for fn in (pass_isend_first, pass_even_odd, pass_irecv_first):
        check_pass_right(three, fn)


def pass_batched(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(t)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, (rank + 1) % p),
                                        dist.P2POp(dist.irecv, buf, (rank - 1) % p)]):
        work.wait()
    return buf


def test_warm_up_judged_for_nccl_takes_only_the_batched_pair(three):
    # lab 00 judges the warm-up as plain torch on NCCL needs it, on these gloo ranks too
    check_pass_right(three, pass_batched, backend="nccl")
    check_pass_right(three, pass_isend_first)  # gloo pairs the ops as they come
    for fn, mistake, note in [
            (pass_isend_first, W.UNBATCHED, "rank 0 called dist.isend to rank 1 outside dist.batch_isend_irecv"),
            (pass_even_odd, W.UNGROUPED, "rank 0 waited for its send to rank 1 before posting its recv")]:
        with pytest.raises(CheckFailed) as err:
            check_pass_right(three, fn, backend="nccl")
        assert err.value.mistake == mistake
        assert note in str(err.value)
    # the rule needs only the backend's name: the same reports, judged for gloo, name another slip
    reports = [{"rank": r, "p": 3, "got": None, "log": {"unbatched": "called dist.isend"}} for r in range(3)]
    for backend, mistake in (("cpu:gloo,cuda:nccl", W.UNBATCHED), ("gloo", W.NOTHING_RETURNED)):
        with pytest.raises(CheckFailed) as err:
            W.diagnose(reports, 7, backend)
        assert err.value.mistake == mistake


@pytest.mark.slow
@pytest.mark.parametrize("fn,mistake", [(everyone_sends_first, W.DEADLOCK),
                                        (from_the_right, W.FROM_THE_RIGHT),
                                        (returns_nothing, W.NOTHING_RETURNED)])
def test_warm_up_names_the_slip_and_leaves_usable_ranks(three, fn, mistake):
    with pytest.raises(CheckFailed) as err:
        check_pass_right(three, fn, timeout=2.0)
    assert err.value.mistake == mistake
    check_pass_right(three, pass_isend_first)


@pytest.mark.slow
def test_a_blocking_gloo_send_returns_only_once_the_receiver_posts_its_recv(three):
    for numel in (1, 1_000_000):  # no size at which gloo buffers the message instead
        r = three.run(ring.send_waits_on_rank, 0.5, numel)[0]
        assert r["backend"] == "gloo"
        assert r["send_s"] >= 0.4, r


def test_a_stall_after_a_rank_returned_with_its_isend_unwaited_is_named_the_missing_wait():
    """Seen in the catalogue under load: a rank returns with its isend still posted, and its
    neighbour then stalls. The cause is the missing wait, not an unpaired exchange."""
    log = {"collectives": [], "unfinished": 0}
    returned = {"rank": 0, "p": 3, "got": None, "log": dict(log, unfinished=1)}
    stalled = {"rank": 1, "p": 3, "stalled": ("recv", 0), "log": log}
    with pytest.raises(CheckFailed) as caught:
        W.diagnose([returned, stalled, dict(stalled, rank=2)], 4)
    assert caught.value.mistake == W.MISSING_WAIT
    # every rank stalled, none returned: the exchange did not pair up
    with pytest.raises(CheckFailed) as caught:
        W.diagnose([dict(stalled, rank=r, log=dict(log, unfinished=1)) for r in range(3)], 4)
    assert caught.value.mistake == W.UNPAIRED

"""Mutation catalogue, point-to-point exercises: lab 00's ring all-reduce and lab 08's pipeline step.

Each function is a learner's solution; ``RING`` and ``PIPELINE`` list the correct ones
and the wrong ones (with the mistake the grader should name, or None where any
CheckFailed is fair). None of these is among the planted mistakes of
tests/checks/test_ring.py or tests/checks/test_checks_labs06_08.py.
"""
import torch
import torch.distributed as dist

from ddplab.checks import pipeline as PC
from ddplab.checks import ring as RC
from ddplab.lessons import pipeline as P


# -- lab 00: ring all-reduce, correct ----------------------------------------------------------
def ring_ok_isend(t):
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    right, left = (rank + 1) % p, (rank - 1) % p
    for s in range(p - 1):  # reduce-scatter
        out, into = chunks[(rank - s) % p], chunks[(rank - s - 1) % p]
        buf = torch.empty_like(into)
        req = dist.isend(out.clone(), dst=right)
        dist.recv(buf, src=left)
        req.wait()
        into += buf
    for s in range(p - 1):  # all-gather
        out, into = chunks[(rank + 1 - s) % p], chunks[(rank - s) % p]
        buf = torch.empty_like(into)
        req = dist.isend(out.clone(), dst=right)
        dist.recv(buf, src=left)
        req.wait()
        into.copy_(buf)


def ring_ok_irecv_isend_lists(t):
    # both async, index arithmetic written as "who owns what after step s"
    rank, p = dist.get_rank(), dist.get_world_size()
    pieces = list(t.chunk(p))
    for step in range(2 * (p - 1)):
        gather = step >= p - 1
        s = step - (p - 1) if gather else step
        send_i = (rank - s + (1 if gather else 0)) % p
        recv_i = (send_i - 1) % p
        incoming = torch.zeros_like(pieces[recv_i])
        works = [dist.irecv(incoming, src=(rank - 1) % p),
                 dist.isend(pieces[send_i].clone(), dst=(rank + 1) % p)]
        for w in works:
            w.wait()
        if gather:
            pieces[recv_i].copy_(incoming)
        else:
            pieces[recv_i].add_(incoming)


def ring_ok_dtype_from_tensor(t):
    # buffers made with new_empty: the dtype and device follow the tensor
    rank, p = dist.get_rank(), dist.get_world_size()
    bounds = [round(i * t.numel() / p) for i in range(p + 1)]
    view = [t[bounds[i]:bounds[i + 1]] for i in range(p)]
    for phase in (0, 1):
        for s in range(p - 1):
            i_out = (rank - s + phase) % p
            i_in = (i_out - 1) % p
            buf = t.new_empty(view[i_in].shape)
            if rank % 2 == 0:
                dist.send(view[i_out].contiguous(), (rank + 1) % p)
                dist.recv(buf, (rank - 1) % p)
            else:
                dist.recv(buf, (rank - 1) % p)
                dist.send(view[i_out].contiguous(), (rank + 1) % p)
            view[i_in].copy_(buf) if phase else view[i_in].add_(buf)


def ring_ok_p2pop_batch(t):
    # each step one batch_isend_irecv of two P2POp, then both works waited
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    right, left = (rank + 1) % p, (rank - 1) % p
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out.contiguous(), right),
                                            dist.P2POp(dist.irecv, buf, left)])
            for w in works:
                w.wait()
            into.copy_(buf) if phase else into.add_(buf)


def ring_ok_p2pop_imported(t):
    # imported names, the recv listed first (order inside a batch does not matter)
    from torch.distributed import P2POp, batch_isend_irecv, irecv, isend

    rank, p = dist.get_rank(), dist.get_world_size()
    pieces = list(t.chunk(p))
    for step in range(2 * (p - 1)):
        gather = step >= p - 1
        send_i = (rank - step % (p - 1) + (1 if gather else 0)) % p
        recv_i = (send_i - 1) % p
        incoming = pieces[recv_i].new_zeros(pieces[recv_i].shape)
        reqs = batch_isend_irecv([P2POp(irecv, incoming, (rank - 1) % p),
                                  P2POp(isend, pieces[send_i].clone(), (rank + 1) % p)])
        [r.wait() for r in reqs]
        pieces[recv_i].copy_(incoming) if gather else pieces[recv_i].add_(incoming)


def ring_ok_p2pop_with_group(t):
    # the group passed explicitly, peers by group rank, a reduce-scatter written as a helper
    from torch.distributed import distributed_c10d as c10d

    group = c10d._get_default_group()
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    chunks = torch.tensor_split(t, p)

    def step(out, into, add):
        buf = torch.empty_like(into)
        ops = [dist.P2POp(dist.isend, out.contiguous(), (rank + 1) % p, group),
               dist.P2POp(dist.irecv, buf, (rank - 1) % p, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if add:
            into += buf
        else:
            into[:] = buf
    for s in range(p - 1):
        step(chunks[(rank - s) % p], chunks[(rank - s - 1) % p], True)
    for s in range(p - 1):
        step(chunks[(rank + 1 - s) % p], chunks[(rank - s) % p], False)


def ring_ok_isend_irecv_imported(t):
    # imported isend/irecv, both posted, then both waited
    from torch.distributed import irecv, isend

    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            works = [isend(out.contiguous(), (rank + 1) % p), irecv(buf, (rank - 1) % p)]
            for w in works:
                w.wait()
            into.copy_(buf) if phase else into.add_(buf)


# -- lab 00: ring all-reduce, wrong --------------------------------------------------------------
def _ring(t, *, buffer=None, gather=True, rs_steps=None, wait=True, rebind=False, send_to=1):
    """The isend ring with one thing changed (each wrong variant below says which)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(t, p))
    right, left = (rank + send_to) % p, (rank - 1) % p
    works = []
    phases = [(rs_steps if rs_steps is not None else p - 1, 0)] + ([(p - 1, 1)] if gather else [])
    for steps, phase in phases:
        for s in range(steps):
            i_out, i_in = (rank - s + phase) % p, (rank - s - 1 + phase) % p
            buf = buffer(chunks[i_in]) if buffer else torch.empty_like(chunks[i_in])
            req = dist.isend(chunks[i_out].clone(), dst=right)
            dist.recv(buf, src=left)
            works.append(req)
            if wait:
                req.wait()
            if phase:
                chunks[i_in] = buf.clone() if rebind else chunks[i_in].copy_(buf)
            elif rebind:
                chunks[i_in] = chunks[i_in] + buf  # a new tensor: t is never written
            else:
                chunks[i_in] += buf


def ring_never_written(t):  # sums into new tensors; t keeps its own values
    _ring(t, rebind=True)


def ring_float64_buffers(t):  # passes in float64, breaks lab 00's float32 cells
    _ring(t, buffer=lambda c: torch.empty(c.shape, dtype=torch.float64))


def ring_float32_buffers(t):
    _ring(t, buffer=lambda c: torch.zeros(c.numel(), dtype=torch.float32))


def ring_isend_never_waited(t):  # the missing wait()
    _ring(t, wait=False)


def ring_one_step_short(t):
    _ring(t, rs_steps=dist.get_world_size() - 2)


def ring_buffer_one_too_long(t):
    _ring(t, buffer=lambda c: torch.empty(c.numel() + 1, dtype=c.dtype))


def ring_buffer_2d(t):  # a (k, 1) buffer: same number of elements, another shape
    _ring(t, buffer=lambda c: torch.empty(c.numel(), 1, dtype=c.dtype))


def ring_sends_left(t):  # sends to the left, receives from the left
    _ring(t, send_to=-1)


def ring_imported_all_reduce(t):
    from torch.distributed import all_reduce  # a collective under another name
    all_reduce(t)


def ring_recv_everyone_first(t):  # every rank posts a blocking recv first
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    buf = torch.empty_like(chunks[(rank - 1) % p])
    dist.recv(buf, src=(rank - 1) % p)
    dist.send(chunks[rank].clone(), dst=(rank + 1) % p)


def ring_p2pop_never_waited(t):  # the works batch_isend_irecv returns are dropped
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            dist.batch_isend_irecv([dist.P2POp(dist.isend, out.contiguous(), (rank + 1) % p),
                                    dist.P2POp(dist.irecv, buf, (rank - 1) % p)])
            into.copy_(buf) if phase else into.add_(buf)


def ring_p2pop_both_right(t):  # the irecv names the right neighbour too
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out.contiguous(), (rank + 1) % p),
                                             dist.P2POp(dist.irecv, buf, (rank + 1) % p)]):
                w.wait()
            into.copy_(buf) if phase else into.add_(buf)


def ring_blocking_even_odd(t):  # right on gloo; a blocking exchange that NCCL needs grouped
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            if rank % 2:
                dist.recv(buf, (rank - 1) % p)
                dist.send(out.contiguous(), (rank + 1) % p)
            else:
                dist.send(out.contiguous(), (rank + 1) % p)
                dist.recv(buf, (rank - 1) % p)
            into.copy_(buf) if phase else into.add_(buf)


def ring_isend_waited_before_recv(t):  # an isend waited at once: a blocking send by another name
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            if rank == 0:
                dist.recv(buf, (rank - 1) % p)
                dist.isend(out.contiguous(), (rank + 1) % p).wait()
            else:
                dist.isend(out.contiguous(), (rank + 1) % p).wait()
                dist.recv(buf, (rank - 1) % p)
            into.copy_(buf) if phase else into.add_(buf)


RING = {
    "check": lambda cluster, fn: RC.check_ring_all_reduce(cluster, fn),
    "world": 3,
    "correct": [ring_ok_isend, ring_ok_irecv_isend_lists, ring_ok_dtype_from_tensor,
                ring_ok_p2pop_batch, ring_ok_p2pop_imported, ring_ok_p2pop_with_group,
                ring_ok_isend_irecv_imported, ring_isend_waited_before_recv],
    "wrong": [(ring_never_written, RC.NEVER_WRITTEN), (ring_float64_buffers, RC.DTYPE_MISMATCH),
              (ring_float32_buffers, RC.DTYPE_MISMATCH), (ring_isend_never_waited, RC.MISSING_WAIT),
              (ring_one_step_short, None), (ring_buffer_one_too_long, RC.WRONG_SPLIT),
              (ring_buffer_2d, None), (ring_sends_left, None), (ring_imported_all_reduce, RC.COLLECTIVE),
              (ring_recv_everyone_first, None), (ring_p2pop_never_waited, RC.MISSING_WAIT),
              (ring_p2pop_both_right, None)],
}

# Lab 00's check judges as NCCL needs (backend="nccl"): only the batched rings pass. Rings that
# wait for one half of an exchange before posting the other are refused (UNGROUPED), and so are
# rings whose sends and recvs were called outside batch_isend_irecv, however they were ordered
# (UNBATCHED: plain torch groups only a batch's ops for NCCL), even on gloo ranks.
def ring_isend_irecv_by_parity(t):  # unbatched, both posted first; odd ranks post the recv first
    rank, p = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(t, p)
    for phase in (0, 1):
        for s in range(p - 1):
            out, into = chunks[(rank - s + phase) % p], chunks[(rank - s - 1 + phase) % p]
            buf = torch.empty_like(into)
            if rank % 2:
                works = [dist.irecv(buf, (rank - 1) % p), dist.isend(out.contiguous(), (rank + 1) % p)]
            else:
                works = [dist.isend(out.contiguous(), (rank + 1) % p), dist.irecv(buf, (rank - 1) % p)]
            for w in works:
                w.wait()
            into.copy_(buf) if phase else into.add_(buf)


# judged for NCCL, the first mistake a wrong gloo ring shows may be its unbatched calls
_FIRST_FOR_NCCL = {ring_never_written: RC.UNBATCHED, ring_float64_buffers: RC.UNBATCHED}  # float64 runs first
RING_NCCL = {
    "check": lambda cluster, fn: RC.check_ring_all_reduce(cluster, fn, backend="nccl"),
    "world": 3,
    "correct": [ring_ok_p2pop_batch, ring_ok_p2pop_imported, ring_ok_p2pop_with_group],
    "wrong": [(ring_blocking_even_odd, RC.UNGROUPED), (ring_ok_dtype_from_tensor, RC.UNGROUPED),
              (ring_isend_waited_before_recv, RC.UNGROUPED),
              (ring_ok_isend_irecv_imported, RC.UNBATCHED), (ring_ok_isend, RC.UNBATCHED),
              (ring_ok_irecv_isend_lists, RC.UNBATCHED), (ring_isend_irecv_by_parity, RC.UNBATCHED)]
             + [(fn, _FIRST_FOR_NCCL.get(fn, named)) for fn, named in RING["wrong"]],
}


# -- lab 08: pipeline step, correct --------------------------------------------------------------
def pipe_ok_irecv(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), 1)
        g = torch.zeros_like(h)
        dist.irecv(g, 1).wait()
        torch.autograd.backward(h, g)
        return None
    h = torch.zeros(act_shape, dtype=y.dtype, device=y.device)
    dist.irecv(h, 0).wait()
    h.requires_grad_(True)
    loss = P.loss_fn(stage(h), y)
    loss.backward()
    dist.isend(h.grad.contiguous(), 0).wait()
    return loss.item()


def pipe_ok_leaf_copy(stage, x, y, act_shape):
    rank = dist.get_rank()
    if rank == 0:
        act = stage(x)
        dist.send(act.detach().clone(), dst=1)
        back = act.detach().new_empty(act.shape)
        dist.recv(back, src=1)
        (act * back).sum().backward()  # the same gradient as act.backward(back)
        return None
    buf = y.new_empty(act_shape)
    dist.recv(buf, src=0)
    h = buf.detach().requires_grad_()
    loss = P.loss_fn(stage(h), y)
    (grad,) = torch.autograd.grad(loss, [h], retain_graph=True)
    loss.backward()
    dist.send(grad, dst=0)
    return loss.detach()


def pipe_ok_grad_via_autograd(stage, x, y, act_shape):
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        grad_h = torch.empty(act_shape, dtype=x.dtype)
        dist.recv(grad_h, src=1)
        h.backward(gradient=grad_h)
        return None
    h = torch.empty(*act_shape, dtype=y.dtype)
    dist.recv(h, src=0)
    h.requires_grad = True
    loss = P.loss_fn(stage(h), y)
    loss.backward()
    dist.send(h.grad, dst=0)
    return float(loss)


# -- lab 08: pipeline step, wrong ------------------------------------------------------------------
def _pipe(stage, x, y, act_shape, *, shape=None, dtype=None, wait=True, send_back=None, back_dtype=None):
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(h.detach(), dst=1)
        g = torch.empty(act_shape, dtype=back_dtype or x.dtype)
        dist.recv(g, src=1)
        h.backward(g.to(h.dtype))
        return None
    h = torch.empty(shape or act_shape, dtype=dtype or y.dtype)
    dist.recv(h, src=0)
    h = h.reshape(act_shape).to(y.dtype).requires_grad_()
    loss = P.loss_fn(stage(h), y)
    loss.backward()
    work = dist.isend(send_back(h, loss) if send_back else h.grad, dst=0)
    if wait:
        work.wait()
    return loss.detach()


def pipe_shape_transposed(stage, x, y, act_shape):
    return _pipe(stage, x, y, act_shape, shape=tuple(reversed(act_shape)))


def pipe_shape_one_row(stage, x, y, act_shape):  # a batch of one
    return _pipe(stage, x, y, (1, act_shape[1]) if dist.get_rank() else act_shape,
                 shape=(1, act_shape[1]))


def pipe_float64_buffer(stage, x, y, act_shape):  # passes in float64, breaks lab 08's float32 cell
    return _pipe(stage, x, y, act_shape, dtype=torch.float64)


def pipe_float32_buffer(stage, x, y, act_shape):
    return _pipe(stage, x, y, act_shape, dtype=torch.float32)


def pipe_float64_grad_buffer(stage, x, y, act_shape):  # rank 0's gradient buffer hard-coded
    return _pipe(stage, x, y, act_shape, back_dtype=torch.float64)


def pipe_isend_never_waited(stage, x, y, act_shape):
    return _pipe(stage, x, y, act_shape, wait=False)


def pipe_sends_output_grad(stage, x, y, act_shape):  # the wrong tensor back: d loss / d out
    return _pipe(stage, x, y, act_shape, send_back=lambda h, loss: torch.zeros(y.shape, dtype=y.dtype))


def pipe_sends_activation_back(stage, x, y, act_shape):
    return _pipe(stage, x, y, act_shape, send_back=lambda h, loss: h.detach())


def pipe_rank1_twice_the_grad(stage, x, y, act_shape):
    return _pipe(stage, x, y, act_shape, send_back=lambda h, loss: h.grad * 2)


def pipe_sends_input(stage, x, y, act_shape):  # rank 0 sends its input, not the activation
    if dist.get_rank() == 0:
        h = stage(x)
        dist.send(x, dst=1)
        g = torch.empty_like(h)
        dist.recv(g, src=1)
        h.backward(g)
        return None
    return _pipe(stage, x, y, act_shape)


PIPELINE = {
    "check": lambda cluster, fn: PC.check_pipeline_step(cluster, fn),
    "world": 2,
    "correct": [pipe_ok_irecv, pipe_ok_leaf_copy, pipe_ok_grad_via_autograd],
    "wrong": [(pipe_rank1_twice_the_grad, PC.WRONG_GRADIENTS),
              (pipe_shape_transposed, PC.SIZE_MISMATCH), (pipe_shape_one_row, PC.SIZE_MISMATCH),
              (pipe_float64_buffer, PC.DTYPE_MISMATCH), (pipe_float32_buffer, PC.DTYPE_MISMATCH),
              (pipe_float64_grad_buffer, PC.DTYPE_MISMATCH), (pipe_isend_never_waited, PC.MISSING_WAIT),
              (pipe_sends_output_grad, PC.SIZE_MISMATCH), (pipe_sends_activation_back, None),
              (pipe_sends_input, PC.SIZE_MISMATCH)],
}

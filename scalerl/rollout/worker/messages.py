"""Messages of tensors between two ranks (prompts to a rollout worker, rollouts back), without pickle.

A message is a list of tensors of any shapes and dtypes. It goes as the length of its int64 header, the
header (the count, then per tensor its dtype code, rank and sizes), then each tensor's bytes, so the
receiver allocates exactly what arrives and nothing is ever unpickled. Every call names its peer and has
the process group's timeout.

gloo's ``send`` returns only once the peer has posted the matching ``recv``; `isend_tensors` returns at once
(a `PendingSend` to wait on later), so a rollout worker can answer and start its next request, and the
trainer can queue requests ahead, without either waiting for the other to read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# A fixed table, the same on every rank: dtype <-> code.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
_HEADER_LIMIT = 1024  # int64 slots: ample for a few dozen tensors of up to 8 dims


def _header(tensors: list[torch.Tensor]) -> torch.Tensor:
    values = [len(tensors)]
    for t in tensors:
        if t.dtype not in _CODE:
            raise TypeError(f"tensor message cannot carry dtype {t.dtype}; supported: {DTYPES}")
        values += [_CODE[t.dtype], t.dim(), *t.shape]
    if len(values) > _HEADER_LIMIT:
        raise ValueError(f"tensor message header of {len(values)} values exceeds {_HEADER_LIMIT}")
    return torch.tensor(values, dtype=torch.int64)


def header_bytes(tensor_dims: list[int] | tuple[int, ...]) -> int:
    """Bytes a message of tensors with these numbers of dimensions sends before its payload: the header's
    length, then the header (the count, then per tensor its dtype code, rank and sizes), int64 each."""
    return 8 * (1 + 1 + sum(2 + d for d in tensor_dims))


def _layout(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = header.tolist()
    count, pos, out = values[0], 1, []
    for _ in range(count):
        dtype, ndim = DTYPES[values[pos]], values[pos + 1]
        out.append((dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return out


def _wire(t: torch.Tensor) -> torch.Tensor:
    # gloo has no bool/bfloat16 point-to-point for every build: move raw bytes where needed.
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype in (torch.bool, torch.bfloat16) else t


def send_tensors(tensors: list[torch.Tensor], dst: int, group=None, device: torch.device | None = None,
                 tag: int = 0) -> int:
    """Send ``tensors`` to global rank ``dst``; returns the payload bytes sent (header included). Messages
    of another ``tag`` between the same two ranks are a separate stream (received with that tag)."""
    device = device or torch.device("cpu")
    header = _header(tensors).to(device)
    dist.send(torch.tensor([header.numel()], device=device), dst=dst, group=group, tag=tag)
    dist.send(header, dst=dst, group=group, tag=tag)
    sent = (header.numel() + 1) * header.element_size()
    for t in tensors:
        wire = _wire(t.to(device))
        dist.send(wire, dst=dst, group=group, tag=tag)
        sent += wire.numel() * wire.element_size()
    return sent


# Messages a sender keeps in flight before it waits for the oldest: gloo's send work reports completion only
# inside ``wait`` (``is_completed`` stays False after the peer has read it), so a sender that only polled
# would hold every message it ever sent. The oldest of this many has long been read where the peer reads in
# order, so the wait is short; it is bounded by the process group's timeout.
MAX_PENDING_SENDS = 16


class PendingSend:
    """A message in flight: its sends' handles and the tensors they read, kept alive until `wait`."""

    def __init__(self, works: list, tensors: list[torch.Tensor], nbytes: int):
        self.works, self.tensors, self.nbytes = works, tensors, nbytes

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Until the peer has read the message; each send is bounded by the process group's timeout."""
        for w in self.works:
            w.wait()
        self.tensors = []


def isend_tensors(tensors: list[torch.Tensor], dst: int, group=None,
                  device: torch.device | None = None, tag: int = 0) -> PendingSend:
    """`send_tensors` without waiting for the peer: the same bytes, in the same order (one peer's messages on
    one group are received in the order they were sent)."""
    device = device or torch.device("cpu")
    header = _header(tensors).to(device)
    wires = [torch.tensor([header.numel()], device=device), header, *(_wire(t.to(device)) for t in tensors)]
    works = [dist.isend(w, dst=dst, group=group, tag=tag) for w in wires]
    return PendingSend(works, wires, sum(w.numel() * w.element_size() for w in wires))


def recv_tensors(src: int, group=None, device: torch.device | None = None, tag: int = 0) -> list[torch.Tensor]:
    """Receive a message sent by `send_tensors` from global rank ``src`` (with ``tag``)."""
    device = device or torch.device("cpu")
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src, group=group, tag=tag)
    return _recv_rest(length, src, group, device, tag)


def recv_tensors_from_any(group=None, device: torch.device | None = None, tag: int = 0
                          ) -> tuple[int, list[torch.Tensor]]:
    """The next message (with ``tag``) from whichever rank of ``group`` sends first, and that rank: the first
    tensor is received from any source, the rest from the one it came from. (gloo's receive handles report
    completion only inside ``wait``, so polling one receive per peer cannot tell which is first.) Only for a
    receiver whose peers on ``group`` and ``tag`` all send whole messages to it the same way."""
    device = device or torch.device("cpu")
    length = torch.empty(1, dtype=torch.int64, device=device)
    src = dist.recv(length, group=group, tag=tag)
    return src, _recv_rest(length, src, group, device, tag)


def _recv_rest(length: torch.Tensor, src: int, group, device: torch.device, tag: int) -> list[torch.Tensor]:
    if not 0 < int(length) <= _HEADER_LIMIT:
        raise RuntimeError(f"rank {src} sent a tensor message header of {int(length)} values; expected 1-{_HEADER_LIMIT}")
    header = torch.empty(int(length), dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=group, tag=tag)
    out = []
    for dtype, shape in _layout(header.cpu()):
        t = torch.empty(shape, dtype=dtype, device=device)
        wire = _wire(t)
        dist.recv(wire, src=src, group=group, tag=tag)
        out.append(t)
    return out


def broadcast_tensors(tensors: list[torch.Tensor] | None, src: int, group=None,
                      device: torch.device | None = None) -> list[torch.Tensor]:
    """Rank ``src`` (global) gives ``tensors``; every rank of ``group`` returns them."""
    device = device or torch.device("cpu")
    is_src = dist.get_rank() == src
    header = _header(tensors).to(device) if is_src else None
    length = torch.tensor([header.numel() if is_src else 0], device=device)
    dist.broadcast(length, src=src, group=group)
    if not is_src:
        header = torch.empty(int(length), dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    out = []
    for i, (dtype, shape) in enumerate(_layout(header.cpu())):
        t = tensors[i].to(device).contiguous() if is_src else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(_wire(t), src=src, group=group)
        out.append(t)
    return out

"""Ring context parallel: each rank's keys and values passed rank to rank, one block per round.

Owns the ring attention of `Plan(cp_method="ring")`: an autograd Function over this rank's
load-balanced share of q, k and v (chunks r and 2*cp-1-r, runtime.parallel.cp_split). Round 0
attends to the rank's own K/V block; in each of the cp-1 rounds after it the block moves
one hop (sent to rank r+1, received from r-1 on the cp group, with isend/irecv) while
attention runs on the block in hand, so the next block's transfer overlaps this one's
compute. Partial outputs are combined with log-sum-exp rescaling; the causal mask (and a
sliding window) is written in global positions of the block's owner. The backward
recomputes each block's probabilities from the saved log-sum-exp (flash attention's way)
and sends the block's dK/dV along with it, so after one last hop every rank holds the
gradient of its own keys and values.

Why our own: torch's `context_parallel` (its ring included) has no sharding strategy for the
CPU SDPA kernel, so causal attention does not run on CPU (measured). Attention is computed
by hand in fp32 (matmul, mask, logsumexp) per block, because SDPA does not return the
log-sum-exp the combination needs. K/V memory per rank: the local block, plus the block in
hand and the one arriving (O(seq/cp), unlike the all-gather's O(seq)).

Knows nothing of transformers, caches or the other mesh axes; the caller (cp.cp_attention)
hands it (B, H, S/cp, D) q and (B, KV, S/cp, D) k, v, GQA groups left unrepeated (a K/V
block crosses the ring at its kv-head width). Dropout is not supported.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .cp_split import local_positions

KV_TAG, GRAD_TAG = 7, 8


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None, groups: int) -> torch.Tensor:
    """[g*s_q, s_k] True where a query may see a key: causal in global positions (and a window)."""
    mask = q_pos[:, None] >= k_pos[None, :]  # [s_q, s_k]
    if window:
        mask &= q_pos[:, None] - k_pos[None, :] < window
    return mask.repeat(groups, 1)  # [g*s_q, s_k]: the query heads sharing a kv head stacked


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, kv, g*s_q, s_k], fp32
    return s.masked_fill(~mask, float("-inf"))


class _Hop:
    """One hop round the ring: post the send to rank r+1 and the receive from r-1, wait later.

    One batch_isend_irecv, not a lone isend and irecv: NCCL launches a batch's pair together, where
    two separate ops on one stream would leave every rank's send waiting for a receive queued
    behind it (gloo just runs the pair)."""

    def __init__(self, t: torch.Tensor, group, tag: int):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.buf = torch.empty_like(t)
        self.works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t, group=group, tag=tag, group_peer=(rank + 1) % cp),
            dist.P2POp(dist.irecv, self.buf, group=group, tag=tag, group_peer=(rank - 1) % cp)])

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        return self.buf


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, (h // kv_heads) * s, d)  # [b, kv, g*s, d]; heads h = kv*g + j


class RingAttention(torch.autograd.Function):
    """(B, H, S/cp, D) q and (B, KV, S/cp, D) k, v -> (B, H, S/cp, D) causal attention output."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale: float, window):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s, d = q.shape
        kvh, groups = k.shape[1], h // k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qf = _grouped(q.float(), kvh)  # [b, kv, g*s, d]
            q_pos = local_positions(s, cp, rank, q.device)
            out = torch.zeros_like(qf)
            lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device)  # [b, kv, g*s]
            block = torch.stack([k, v]).contiguous()  # [2, b, kv, s/cp, d], the block that travels
            for step in range(cp):
                hop = _Hop(block, group, KV_TAG) if step < cp - 1 else None  # next block in flight
                src = (rank - step) % cp
                mask = _mask(q_pos, local_positions(s, cp, src, q.device), window, groups)
                sc = _scores(qf, block[0].float(), mask, scale)  # [b, kv, g*s, s/cp]
                part = torch.logsumexp(sc, -1)  # [b, kv, g*s]; -inf where no key is visible
                p = torch.exp(sc - part.nan_to_num(neginf=0.0)[..., None])
                new = torch.logaddexp(lse, part)
                # rows with nothing seen yet keep lse -inf; their weight is then 0 (not NaN)
                keep = torch.exp(lse - new).nan_to_num(0.0)[..., None]
                take = torch.exp(part - new).nan_to_num(0.0)[..., None]
                out = out * keep + torch.matmul(p, block[1].float()) * take  # [b, kv, g*s, d]
                lse = new
                if hop is not None:
                    block = hop.wait()
        out = out.to(q.dtype)  # saved and returned as one tensor
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.window = group, scale, window
        return out.view(b, h, s, d)  # [b, heads, s/cp, d]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        b, h, s, d = q.shape
        kvh, groups = k.shape[1], h // k.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qf, do = _grouped(q.float(), kvh), _grouped(grad.float(), kvh)  # [b, kv, g*s, d]
            delta = (do * out.float()).sum(-1, keepdim=True)  # [b, kv, g*s, 1]
            q_pos = local_positions(s, cp, rank, q.device)
            dq = torch.zeros_like(qf)
            block = torch.stack([k, v]).contiguous()  # [2, b, kv, s/cp, d]
            dkv = torch.zeros(block.shape, dtype=torch.float32, device=q.device)  # travels with its block
            for step in range(cp):
                src = (rank - step) % cp
                hop = _Hop(block, group, KV_TAG) if step < cp - 1 else None
                mask = _mask(q_pos, local_positions(s, cp, src, q.device), ctx.window, groups)
                kf, vf = block[0].float(), block[1].float()
                p = torch.exp(_scores(qf, kf, mask, scale) - lse[..., None])  # [b, kv, g*s, s/cp]
                dp = torch.matmul(do, vf.transpose(-1, -2))  # [b, kv, g*s, s/cp]
                ds = p * (dp - delta) * scale
                dq += torch.matmul(ds, kf)
                dkv = dkv + torch.stack([torch.matmul(ds.transpose(-1, -2), qf),  # dK [b, kv, s/cp, d]
                                         torch.matmul(p.transpose(-1, -2), do)])  # dV
                # the block's gradient goes where the block goes; the last hop takes it home
                dkv = _Hop(dkv.contiguous(), group, GRAD_TAG).wait()
                if hop is not None:
                    block = hop.wait()
        return dq.reshape(b, h, s, d).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, scale: float, window=None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys, round by round."""
    return RingAttention.apply(q, k, v, group, scale, window)

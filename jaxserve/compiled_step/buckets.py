"""The grid of padded shapes compiled at start-up, and picking a bucket for a step."""

from __future__ import annotations

import bisect
import dataclasses


def geometric(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo*factor, ... below hi, then hi itself."""
    out = []
    x = lo
    while x < hi:
        out.append(x)
        x *= factor
    out.append(hi)
    return tuple(sorted(set(out)))


@dataclasses.dataclass(frozen=True)
class BucketGrid:
    token_buckets: tuple[int, ...]  # padded token counts T
    request_buckets: tuple[int, ...]  # padded request counts R

    @classmethod
    def build(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        token_buckets: tuple[int, ...] | None = None,
        request_buckets: tuple[int, ...] | None = None,
    ) -> BucketGrid:
        tb = token_buckets or geometric(min(16, max_num_batched_tokens), max_num_batched_tokens)
        # Request buckets start at 8 rows: on XLA:CPU a bfloat16 product with fewer rows is far
        # slower, and the logits of 8 rows cost little more than of one anywhere.
        rb = request_buckets or geometric(min(8, max_num_seqs), max_num_seqs, factor=4)
        if max(tb) < max_num_batched_tokens:
            raise ValueError(f"the largest token bucket {max(tb)} is below max_num_batched_tokens {max_num_batched_tokens}")
        if max(rb) < max_num_seqs:
            raise ValueError(f"the largest request bucket {max(rb)} is below max_num_seqs {max_num_seqs}")
        if min(tb) < 1 or min(rb) < 1:
            raise ValueError("buckets must be positive")
        return cls(tuple(sorted(set(tb))), tuple(sorted(set(rb))))

    def shapes(self) -> list[tuple[int, int]]:
        """Every (T, R) pair compiled: R is capped by T (a step has at least one token per request)."""
        out = []
        for t in self.token_buckets:
            for r in self.request_buckets:
                if r <= t:
                    out.append((t, r))
        return sorted(set(out))

    def pick(self, num_tokens: int, num_reqs: int) -> tuple[int, int]:
        """The smallest compiled (T, R) holding this step. Raises if none does (a bug)."""
        i = bisect.bisect_left(self.token_buckets, num_tokens)
        j = bisect.bisect_left(self.request_buckets, num_reqs)
        if i == len(self.token_buckets) or j == len(self.request_buckets):
            raise RuntimeError(f"no compiled bucket holds {num_tokens} tokens / {num_reqs} requests")
        t = self.token_buckets[i]
        r = self.request_buckets[j]
        while r > t:  # R above T was not compiled; take a larger T
            i += 1
            if i == len(self.token_buckets):
                raise RuntimeError(f"no compiled bucket holds {num_tokens} tokens / {num_reqs} requests")
            t = self.token_buckets[i]
        return t, r

    def pick_requests(self, num_reqs: int) -> int:
        """The smallest request bucket holding `num_reqs` rows (a decode block's R). Raises if
        none does (a bug)."""
        j = bisect.bisect_left(self.request_buckets, num_reqs)
        if j == len(self.request_buckets):
            raise RuntimeError(f"no request bucket holds {num_reqs} requests")
        return self.request_buckets[j]

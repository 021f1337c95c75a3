"""Kernel side: magics that measure the ranks' hardware: %dist_bench.

Registered by :func:`nbdist.magics.register`; each magic parses its line and
calls the library (:mod:`nbdist.driver.comm_table`).
"""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from nbdist.errors import PlacementError
from nbdist.launch.values import parse_count
from nbdist.magics.args import SessionMagics, asked_for_help, parse_magic_line

__all__ = ["PerfMagics"]


@magics_class
class PerfMagics(SessionMagics):
    """%dist_bench: on the session ``self.dist`` holds."""

    @magic_arguments()
    @argument("what", help="what to measure: comm (the collectives between the ranks)")
    @argument(
        "--sizes", default=None, help="message sizes, e.g. 1K,1M,64M (default 1K..64M, GPU 1G)"
    )
    @argument(
        "--ops",
        default=None,
        help="some of all_reduce,all_gather,reduce_scatter,broadcast (default: all)",
    )
    @argument("--iters", default=None, help="timed calls per size (default: fewer for large sizes)")
    @argument("--no-pairs", action="store_true", help="leave out rank 0's send/recv with each rank")
    @line_magic
    def dist_bench(self, line=""):
        """Latency (µs) and bandwidth (GB/s) of the collectives between the running ranks.

        Usage: ``%dist_bench comm [--sizes 1K,1M,64M] [--ops all_reduce,broadcast] [--iters N]``

        Per op and size, on the ranks' devices: the median time of a call over
        iterations after warm-up (each call between barriers, the slowest rank's
        time, CUDA-synchronised on GPU), algBW = size / time and busBW as
        nccl-tests computes it (all_reduce x 2(n-1)/n, all_gather and
        reduce_scatter x (n-1)/n, broadcast x 1), comparable with the links'
        hardware bandwidth. Then rank 0 exchanges one size with each other
        rank, both ways at once (``sendrecv 0↔r``), so a slow link stands out.
        Sizes are whole buffers as in nccl-tests (an all_gather's output).
        Examples::

            %dist_bench comm
            %dist_bench comm --sizes 1K,1M,64M --ops all_reduce,all_gather --iters 20

        The table as a DataFrame: nbdist.driver.comm_table.bench_comm(sizes="1K,64M").
        """
        from nbdist.driver.comm_table import measure_comm

        if asked_for_help(self.dist_bench, line):
            return
        args = parse_magic_line(self.dist_bench, line)
        if args.what != "comm":
            raise UsageError(
                f"%dist_bench {args.what!r}: only 'comm' is measured, e.g. %dist_bench comm"
            )
        session = self.dist.running_session()
        try:
            iters = parse_count(args.iters, "--iters", "20") if args.iters is not None else None
            result = measure_comm(
                session, sizes=args.sizes, ops=args.ops, iters=iters, pairs=not args.no_pairs
            )
        except PlacementError as exc:
            raise UsageError(str(exc)) from None
        print(result.report())

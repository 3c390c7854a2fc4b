"""Ranks: --tensor-parallel N processes on torch.distributed (gloo on the CPU), each with its share of the experts.

    parallel.py     launch the ranks, lockstep each engine call from rank 0 (Leader), agree, exchange partial sums
    rank.py         a rank's process: its engine, replaying rank 0's calls
    dense_split.py  attention heads and dense MLPs split over the ranks where the modules decode
"""

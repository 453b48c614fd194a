"""``pagedserve-bench``: a load generator and its workloads, shipped with the client (extra ``bench``)."""

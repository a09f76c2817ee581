"""`tandem bench autoscale`: the SLO autoscaler against the best static layout on a time-varying trace."""

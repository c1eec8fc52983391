"""Layer 4 (on engines' costs and runtime): the compute / communication SM split: the policy shared with
the kernels (split_policy.cuh) and the search across calls that feeds comm_sms="auto"."""

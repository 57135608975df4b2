"""Training tooling, never needed by a saved model: the recipes' shared loop and plumbing (`training`), their
collators (`collators`), context parallelism at the model level (`context_parallel`: turning it on, sharding
a batch, summing gradients) and the offline long-range tasks (`data`, the `longattn-data` command)."""

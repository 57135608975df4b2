"""Training tooling, never needed by a saved model: the recipes' shared loop and plumbing (`training`), their
collators (`collators`) and the offline long-range tasks (`data`, the `longattn-data` command)."""

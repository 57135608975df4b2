"""longattn's command-line tools (console scripts declared in pyproject.toml), never needed by a saved model:
Hub-ready folders, model cards and uploads (`hub`, `longattn-hub`), pictures of patterns (`visualize`,
`longattn-visualize`) and lengthening a stock checkpoint (`lengthen`, `longattn-lengthen`)."""

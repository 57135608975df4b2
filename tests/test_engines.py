"""Engines: FSDP2 sharding of a longattn model over gloo, the kinds with per-rank state (LSH rotations, routing
centroids) kept in step across processes, and the accelerate configs of recipes/configs.

The multi-process tests (marker `distributed`, part of the default suite) fork a few processes from the test process
(no re-import of torch: about a second per run), each with one thread, joined by a file store (no port to collide
with a parallel test run). Each compares a data-parallel run with one process that sees the whole batch: a tiny
masked LM (hidden 32, 2 layers, length 64, dropout off, every token labelled, the batch split evenly, so the mean of
the ranks' mean losses is the mean loss of the batch and the engines' gradient average is its gradient), three AdamW
steps, losses and every weight and buffer within 1e-5.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from child_processes import start_ranks
from kind_configs import random_ids, tiny_config
from transformers import AutoModelForMaskedLM

from longattn.attention_lsh import LSHAttention

STEPS = 3
BATCH = 4
LENGTH = 64
LSH_AND_ROUTING = dict(
    attention_type=["lsh", "routing"],
    lsh_bucket_size=8,
    lsh_num_buckets=4,
    routing_num_clusters=4,
    routing_ema_decay=0.5,  # a large step, so that a centroid update one rank missed shows
)


def _model(fields: dict):
    torch.manual_seed(0)
    return AutoModelForMaskedLM.from_config(tiny_config(**{"attention_type": "sliding", "sliding_window": 8, **fields}))


def _step_seed(step: int, rank: int) -> int:
    """The seed a rank draws its step's randomness from: one per (step, process), as the recipes seed dropout, so
    rank 0 draws what the single process draws and the other ranks draw otherwise."""
    return 1000 * step + rank


def _train(model, ids: torch.Tensor, rank: int, record_rotations: list) -> tuple[list[float], list]:
    """STEPS AdamW steps on `ids` (every token labelled); the losses and each step's routing centroids."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, centroids = [], []
    original = LSHAttention.current_rotations

    def recording(layer, device):
        rotations = original(layer, device)
        record_rotations.append(rotations.clone())
        return rotations

    LSHAttention.current_rotations = recording
    try:
        for step in range(STEPS):
            torch.manual_seed(_step_seed(step, rank))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            centroids.append([b.detach().clone() for n, b in model.named_buffers() if n.endswith("centroids")])
    finally:
        LSHAttention.current_rotations = original
    return losses, centroids


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (a sharded parameter) gathered whole; a plain tensor (a buffer) as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _wrap(model, engine: str, mesh_shape: tuple[int, ...]):
    """`model` under DDP, or sharded with `fully_shard` per layer and at the root on a CPU mesh (1-D: FSDP; 2-D:
    hybrid, replicated over the first dimension and sharded over the second)."""
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard")[-len(mesh_shape) :])
    for layer in model.longattn.encoder.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _worker(rank: int, world: int, store: str, out: str, engine: str, mesh_shape: tuple[int, ...], fields: dict):
    """One rank: the model under `engine`, trained on its slice of the batch; what it saw is saved for the test
    process to compare."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = _wrap(_model(fields), engine, mesh_shape)
        per_rank = BATCH // world
        ids = random_ids(BATCH, LENGTH, seed=1)[rank * per_rank : (rank + 1) * per_rank]
        rotations: list = []
        losses, centroids = _train(model, ids, rank, rotations)
        mean_losses = torch.stack(losses)
        dist.all_reduce(mean_losses)
        state = {
            name.removeprefix("module."): _full(value).detach().clone() for name, value in model.state_dict().items()
        }
        result = {
            "losses": (mean_losses / world).tolist(),
            "state": state,
            "rotations": rotations,
            "centroids": centroids,
        }
        if engine == "fsdp":
            weight = model.longattn.encoder.layers[0].self_attn.q_proj.weight
            result["placements"] = [type(p).__name__ for p in weight.placements]
            result["local_rows"] = weight.to_local().shape[0]
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _run_ranks(tmp_path: Path, mesh_shape: tuple[int, ...], fields: dict, engine: str = "fsdp") -> list[dict]:
    world = int(torch.tensor(mesh_shape).prod())
    # Each rank sets its own thread count first.
    start_ranks(_worker, args=(world, str(tmp_path / "store"), str(tmp_path), engine, mesh_shape, fields), nprocs=world)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


def _one_process(fields: dict) -> tuple[list[float], dict, list, list]:
    model = _model(fields)
    rotations: list = []
    losses, centroids = _train(model, random_ids(BATCH, LENGTH, seed=1), 0, rotations)
    return [float(loss) for loss in losses], model.state_dict(), rotations, centroids


def _assert_same_run(ranks: list[dict], fields: dict) -> None:
    losses, state, _, _ = _one_process(fields)
    for result in ranks:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=0, atol=1e-5)
        assert result["state"].keys() == state.keys()
        for name, value in state.items():
            torch.testing.assert_close(result["state"][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(autouse=True)
def _single_threaded():
    """One intra-op thread, as the ranks have: the single-process reference then sums in the same order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.distributed
def test_fully_shard_two_processes_matches_one_process(tmp_path):
    ranks = _run_ranks(tmp_path, (2,), {})
    assert ranks[0]["placements"] == ["Shard"] and ranks[0]["local_rows"] == 32 // 2  # really sharded
    _assert_same_run(ranks, {})


@pytest.mark.distributed
def test_hybrid_shard_two_by_two_matches_one_process(tmp_path):
    """HSDP: replicated over the first mesh dimension, sharded over the second; four ranks, one example each."""
    ranks = _run_ranks(tmp_path, (2, 2), {})
    assert ranks[0]["placements"] == ["Replicate", "Shard"]
    _assert_same_run(ranks, {})


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["fsdp", "ddp"])
def test_lsh_rotations_and_routing_centroids_stay_in_step(tmp_path, engine):
    """Each rank seeds its step differently (as the recipes do for dropout): the LSH layer still hashes with the
    same rotations on both (rank 0's, which the single process draws too), and the routing layer moves its centroids
    by the statistics of the whole batch on both, so the run equals the single process. Under DDP too, whose
    gradient all-reduce runs beside the routing layer's all-reduce in the same backward pass."""
    ranks = _run_ranks(tmp_path, (2,), LSH_AND_ROUTING, engine)
    _, _, rotations, centroids = _one_process(LSH_AND_ROUTING)
    assert len(ranks[0]["rotations"]) == STEPS  # one LSH layer, one training forward per step
    for result in ranks:
        for got, expected in zip(result["rotations"], rotations, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for result in ranks:
        for got, expected in zip(result["centroids"], centroids, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    _assert_same_run(ranks, LSH_AND_ROUTING)


def test_rank_sync_without_a_process_group_leaves_tensors_alone():
    from longattn import rank_sync

    assert not dist.is_initialized() and not rank_sync.is_multi_process()
    x, y = torch.arange(3.0), torch.ones(2, dtype=torch.long)
    assert rank_sync.same_on_every_rank(x) is x and x.tolist() == [0.0, 1.0, 2.0]
    assert rank_sync.sum_over_ranks(x, y) == (x, y) and y.tolist() == [1, 1]


# ---------------------------------------------------------------------------------------------- accelerate configs
CONFIGS = Path(__file__).resolve().parents[1] / "recipes" / "configs"


def _launch(monkeypatch, config: str):
    """`accelerate launch --config_file recipes/configs/<config> recipes/run_mlm.py` up to the environment it gives
    the processes (accelerate's own parsing, validation and environment), set here with monkeypatch; its arguments."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / config), "recipes/run_mlm.py"])
    args, defaults, _ = _validate_launch_command(args)
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as `launch_command` does
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        if os.environ.get(key) != value and key.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    return args


def test_every_config_loads_with_accelerate():
    from accelerate.commands.config.config_args import load_config_from_file

    names = sorted(path.name for path in CONFIGS.glob("*.yaml"))
    assert {"deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "fsdp.yaml", "fsdp_hybrid.yaml"} <= set(names)
    for name in names:
        config = load_config_from_file(str(CONFIGS / name))  # unknown keys raise
        assert config.compute_environment == "LOCAL_MACHINE", name


@pytest.mark.parametrize("config", ["fsdp.yaml", "fsdp_hybrid.yaml"])
def test_fsdp_configs_build_fsdp2_plugins(monkeypatch, config):
    from accelerate import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from longattn import modeling_longattn

    args = _launch(monkeypatch, config)
    assert args.use_fsdp and os.environ["ACCELERATE_USE_FSDP"] == "true"
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert all(hasattr(modeling_longattn, name) for name in plugin.transformer_cls_names_to_wrap)
    if config == "fsdp_hybrid.yaml":
        mesh = ParallelismConfig()  # from the environment, as the Accelerator builds it
        assert (mesh.dp_replicate_size, mesh.dp_shard_size) == (2, 2) and mesh.total_size == args.num_processes == 4
    else:
        assert os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") is None


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_build_zero_plugins_that_take_the_recipe_settings(monkeypatch, stage):
    """The DeepSpeed plugin accelerate builds from each config (DeepSpeed itself is not needed for that): its ZeRO
    stage, no accumulation of its own, and the clipping left to the recipe, which fills in --max_grad_norm."""
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin

    from longattn.train import training

    _launch(monkeypatch, f"deepspeed_zero{stage}.yaml")
    plugin = DeepSpeedPlugin()
    assert plugin.zero_stage == stage and plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    assert plugin.deepspeed_config["gradient_clipping"] == "auto"
    if stage == 3:
        assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), distributed_type="DEEPSPEED")
    training.configure_deepspeed(SimpleNamespace(max_grad_norm=0.5), accelerator)
    assert plugin.deepspeed_config["gradient_clipping"] == 0.5
    accelerator.num_processes = 2
    assert training.shards_parameters(accelerator) is (stage == 3)


def test_deepspeed_config_that_clips_or_accumulates_otherwise_is_refused(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DeepSpeedPlugin

    from longattn.train import training

    _launch(monkeypatch, "deepspeed_zero2.yaml")
    for field, value in (("gradient_clipping", 1.0), ("gradient_accumulation_steps", 4)):
        plugin = DeepSpeedPlugin()
        plugin.deepspeed_config[field] = value
        accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))
        with pytest.raises(training.RecipeError, match=field):
            training.configure_deepspeed(SimpleNamespace(max_grad_norm=0.5), accelerator)


# ---------------------------------------------------------------------------------------------- FSDP asked on CPU
@pytest.mark.parametrize("processes", [1, 2])
def test_an_fsdp_run_that_would_be_ddp_on_cpu_is_refused(processes):
    from types import SimpleNamespace

    from longattn.train import training

    on_cpu = SimpleNamespace(distributed_type="MULTI_CPU" if processes > 1 else "NO", num_processes=processes)
    instead = "DDP" if processes > 1 else "one unsharded process"
    with pytest.raises(training.RecipeError, match=f"FSDP needs CUDA; on CPU accelerate would run {instead}"):
        training.check_engine(on_cpu, "FSDP")
    with pytest.raises(training.RecipeError, match="DeepSpeed needs CUDA"):
        training.check_engine(on_cpu, "DEEPSPEED")
    training.check_engine(on_cpu, None)  # DDP asked, DDP run
    for on_gpus in ("MULTI_GPU", "FSDP"):  # the process state on GPUs, or the Accelerator's
        training.check_engine(SimpleNamespace(distributed_type=on_gpus, num_processes=processes), "FSDP")


@pytest.mark.parametrize("config", ["fsdp.yaml", "fsdp_hybrid.yaml", "deepspeed_zero3.yaml"])
def test_make_accelerator_refuses_the_sharding_configs_on_cpu(tmp_path, monkeypatch, config):
    """The environment `accelerate launch --config_file recipes/configs/<config>` gives a process, on CPU: the
    recipe stops with the one-line error instead of training unsharded (DeepSpeed: first because it is not
    installed, where it is not)."""
    import importlib.util

    from accelerate.state import AcceleratorState

    from longattn.train import training

    _launch(monkeypatch, config)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # the config's bf16 is not what this test is about
    parser = training.recipe_parser(None, task="mlm")
    args = training.parse_args(parser, ["--output_dir", str(tmp_path), "--train_file", _text_file(tmp_path)])
    if config.startswith("fsdp"):
        message = "FSDP needs CUDA; on CPU accelerate would run"
    elif importlib.util.find_spec("deepspeed") is None:
        message = "DeepSpeed is not installed"
    else:
        message = "DeepSpeed needs CUDA; on CPU accelerate would run"
    try:
        with pytest.raises(training.RecipeError, match=message):
            training.make_accelerator(args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _text_file(tmp_path: Path) -> str:
    path = tmp_path / "train.txt"
    path.write_text("some text\n" * 4)
    return str(path)

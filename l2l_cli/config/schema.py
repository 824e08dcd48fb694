"""The config schema: the single home of defaults.

Group YAMLs under conf/ extend these dataclasses; unknown keys (also via ``+key=``) are rejected by the
structured-config merge. Cross-field rules live in :mod:`l2l_cli.config.validate`, one function per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

PRECISIONS = ("fp32", "amp", "cmp", "mixed")
HALF_DTYPES = ("auto", "bf16", "fp16")
LOSS_SCALE = ("dynamic", "none")
SCHEDULES = ("linear", "cosine", "constant")
CLIP = ("auto", "global", "layer", "none")
DEVICES = ("auto", "cpu", "cuda", "sim")
PROGRESS = ("auto", "rich", "plain", "none")
DIST_BACKENDS = ("auto", "gloo", "nccl")
PLACEMENTS = ("modular", "contiguous")  # pipeline stages: layer i on rank i mod P, or blocks of L/P layers
PIPE_SCHEDULES = ("auto", "breadth_first", "interleaved_1f1b", "gpipe", "1f1b")
SCALES = ("cpu", "paper")
PLAN_NETWORKS = ("infiniband", "ethernet")
PEFT_METHODS = ("none", "lora")
BASE_DTYPES = ("fp32", "bf16", "fp16", "int8", "nf4")
BASE_SOURCES = ("host", "disk")
PIPE_LINKS = ("nccl", "gloo")  # hardware.pipe_link: the transport a preset's pipeline figures describe


@dataclass
class ModelConfig:
    """The model: a family (``bert``, ``gpt2``, ``llama``) and its sizes, or a pretrained checkpoint. ``x``
    selects the layered-GA paper's X[x] family of sizes (derived from x)."""

    name: str = "bert-tiny"  # the size's name (set by the model group)
    family: str = "bert"  # the model family; with model.pretrained, the checkpoint's model_type decides
    num_layers: int = 2  # transformer blocks (the papers' #LAYER)
    hidden_size: int = 128  # width of the hidden states
    num_heads: int = 2  # attention heads (must divide hidden_size)
    intermediate_size: int = 512  # width of each block's MLP
    # hidden and attention dropout; unset: the checkpoint's own with model.pretrained (BERT's and GPT-2's
    # 0.1, Llama's attention_dropout 0.0, as transformers and PEFT train them), else 0.1
    dropout: float | None = None
    vocab_size: int = 30522  # token ids (30522: the uncased WordPiece vocabulary)
    seq_len: int = 512  # max positions (the papers' d_s for tnlg / X[x])
    type_vocab_size: int = 2  # segment ids (sentence A / B)
    layer_norm_eps: float = 1e-12  # LayerNorm (bert, gpt2) or RMSNorm (llama) epsilon
    init_std: float = 0.02  # std of the normal initialization
    pretrained: str | None = (
        None  # hub id or local HF directory to start from (its config.json sets the sizes)
    )
    x: int | None = None  # the X[x] family member (model=x)
    num_kv_heads: int | None = None  # llama: key/value heads (grouped-query attention); unset = num_heads
    rope_theta: float = 10000.0  # llama: the rotary embedding's base
    tie_word_embeddings: bool = True  # decoders: the LM head is the token embedding (one tensor)
    lr: float = 1e-3  # this size's default learning rate (optim.lr when nothing else sets it)


@dataclass
class ModeConfig:
    """Execution algorithm (a registered mode). ``stash`` and ``prefetch`` belong to the L2L runners."""

    name: str = "l2l"  # the execution algorithm (set by the mode group)
    stash: str | None = None  # device | cpu (modes with a stash; unset: the mode's default)
    prefetch: bool = True  # relay: copy layer l+1 while layer l computes
    recompute: str = (
        "full"  # L2L modes: full | selective (matmul outputs kept) | none (nothing recomputed) | auto
    )
    keep_layers: Any = None  # L2L modes: the last N blocks keep their activations (no recompute) | auto
    activation_budget_gb: float | None = (
        None  # recompute auto on a CPU device: GiB (unset: half the free RAM)
    )
    cuda_graphs: str = "auto"  # L2L modes: blocks as CUDA graphs: on | off | auto (CUDA, small micro-batches)


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp (autocast, master on device) | cmp (half device copy, FP32 master in EPS)
    dtype: str = "auto"  # half type for amp/cmp: auto = fp16 on CUDA, bf16 elsewhere (fp16 crawls on CPUs)
    loss_scale: str = "dynamic"  # dynamic | none (for half precision)
    init_scale: float = 65536.0  # dynamic loss scaling: the first scale
    growth_interval: int = 2000  # dynamic loss scaling: steps without overflow before the scale doubles


SHAREGPT_ROLES = {
    "human": "user",
    "gpt": "assistant",
}  # ShareGPT's speakers; system, user... map to themselves


@dataclass
class ChatFieldsConfig:
    messages: str | None = None  # task=chat: the field holding the turns; unset: messages, else conversations
    role: str | None = None  # task=chat: a turn's speaker key; unset: role, else from (ShareGPT)
    content: str | None = None  # task=chat: a turn's text key; unset: content, else value (ShareGPT)
    roles: dict[str, str] = field(
        default_factory=lambda: dict(
            SHAREGPT_ROLES
        )  # task=chat: other speaker names -> system|user|assistant|tool
    )


@dataclass
class TaskConfig:
    name: str = "synthetic"  # the task (set by the task group)
    data_dir: str | None = None  # original GLUE TSV layout; unset = the hub (GLUE) or generated (synthetic)
    max_seq_len: int = 64  # tokens per example (longer ones are truncated; task=lm: the block length)
    tokenizer: str | None = None  # unset: model.pretrained's, else the bundled one (WordPiece; lm: byte BPE)
    max_train_samples: int | None = None  # use only the first N training examples
    max_eval_samples: int | None = None  # evaluate on only the first N dev examples
    pad_to_max: bool = False  # pad every batch to max_seq_len (constant shapes, for memory studies)
    num_train: int = 8192  # synthetic task: training examples
    num_eval: int = 1024  # synthetic task: dev examples
    files: Any = (
        None  # task=lm|chat|csv|json: your training files (a path or a list; lm unset: the bundled corpus)
    )
    dev_files: Any = (
        None  # task=lm|chat|csv|json: dev files; unset = lm: task.dev_fraction, csv|json: 10% held out
    )
    text_field: str = "text"  # task=lm: the field holding the text in .jsonl/.parquet rows
    dev_fraction: float = (
        0.05  # task=lm|chat: the last share of the packed blocks (chat: examples) kept as dev
    )
    text_fields: Any = field(
        default_factory=lambda: ["text"]
    )  # task=csv|json: 1 or 2 text columns (or one name)
    label_field: str = "label"  # task=csv|json: the label column
    regression: bool | None = None  # task=csv|json: numeric target; unset = numbers that are not all integers
    format: str = (
        "auto"  # task=chat: auto | messages | instruction (instruction/input/output) | prompt_completion
    )
    chat_template: str | None = (
        None  # task=chat: chatml | llama3 | a Jinja chat template (text or a file); unset: the tokenizer's
    )
    fields: ChatFieldsConfig = field(default_factory=ChatFieldsConfig)  # task=chat: the rows' keys (ShareGPT)
    train_on: str = "assistant"  # task=chat: assistant (loss on the answers only) | all (every token)
    packing: bool = False  # task=chat: several examples per row, attention kept inside each (else padding)
    dataset: str | None = (
        None  # task=lm|chat: a hub dataset id, or a local folder of data files (not task.files)
    )
    dataset_config: str | None = None  # task=lm|chat: the hub dataset's configuration (name)
    split: str = "train"  # task=lm|chat: the dataset's training split
    dev_split: str | None = None  # task=lm|chat: the dataset's dev split; unset: task.dev_fraction of train
    streaming: bool = (
        False  # task=lm|chat: read the data as a stream (tokenized on the fly; trainer.max_steps)
    )


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | lamb | adamw8bit (set by the optim group)
    lr: float = "${model.lr}"  # peak learning rate; default: model.lr (GLUE, csv, json tasks: 5e-5)
    weight_decay: float = 0.01  # decoupled weight decay (not on biases and LayerNorms)
    beta1: float = 0.9  # Adam beta1
    beta2: float = 0.999  # Adam beta2
    eps: float = 1e-6  # Adam epsilon
    warmup_ratio: float = 0.1  # share of the steps spent warming up the learning rate
    warmup_steps: int | None = None  # warmup in steps (overrides warmup_ratio)
    schedule: str = "linear"  # after warmup: linear (decay to 0) | cosine (decay to 0) | constant
    clip: str = "auto"  # auto (the mode's default: global in every built-in mode) | global | layer | none
    max_grad_norm: float = 1.0  # clipping threshold (global norm, or per layer with clip=layer)


@dataclass
class BatchConfig:
    size: int = 32  # samples per optimizer step per device
    ubatch_size: int = 8  # micro-batch; #ubatches = size / ubatch_size
    eval_size: int | None = None  # eval batch; unset = batch.size


@dataclass
class TrainerConfig:
    max_steps: int = -1  # -1: run trainer.epochs
    epochs: int = 1  # passes over the training set (when max_steps is -1)
    seed: int = 0  # weights, data order and dropout follow it
    eval_every: int = 0  # 0: evaluate once, at the end
    log_every: int = 1  # steps between metrics rows
    save_final: bool = False  # write final/: a Hugging Face model directory of the trained weights
    save_every: int = 0  # steps between checkpoints (0: none; with N, also one at the end)
    keep_checkpoints: int = 2  # how many step checkpoints to keep
    resume: str | None = None  # a run dir, or "latest": continue it with its own config (overrides win)
    realtime_ckpt: bool = False  # L2L modes: the EPS writes each layer right after its update
    max_bad_steps: int = 3  # non-finite steps in a row that stop the run
    progress: str = "auto"  # auto | rich | plain | none
    save_best: str | None = None  # an eval metric (auto: the task's main one): best/ holds the best weights
    early_stopping_patience: int = 0  # with save_best: evaluations without improvement that end the run


@dataclass
class DeviceConfig:
    """Where the run executes (``device=auto|cpu|cuda|sim``, the group) and how much of its memory it may
    use (``device.memory_gb``: a larger card run as a smaller one)."""

    name: str = "auto"  # auto (CUDA when present, else the CPU) | cpu | cuda | sim (a simulated accelerator)
    # the device memory the run may use, GiB (unset: all of it). cuda: the caching allocator's cap
    # (torch.cuda.set_per_process_memory_fraction; the CUDA context is beyond it); cpu: the meter enforces
    # it as the simulator does (an out-of-memory past it); sim: its budget is sim.memory_gb
    memory_gb: float | None = None


@dataclass
class SimConfig:
    """Simulated accelerator: a device-memory budget and a host<->device link, on the CPU."""

    memory_gb: float = 16.0  # device memory budget, GiB (exceeding it is an out-of-memory)
    link_gbps: float = 16.0  # GB/s (bytes), per direction, like the papers' "16 GB/sec PCIe"


@dataclass
class DistConfig:
    nproc: int = 1  # data-parallel processes (torch's elastic launcher)
    backend: str = "auto"  # auto = nccl on CUDA, gloo otherwise
    timeout_s: float = 600.0  # a collective that waits longer ends the job (a dead rank ends it at once)
    eager_reduce: bool = True  # L2L: reduce each layer's gradient as it lands (false: all after backward)
    # pipeline parallelism (layered-GA §4, on torch.distributed.pipelining): P ranks per pipeline, nproc/P
    # pipelines side by side (data parallel); mode.name is the algorithm each stage runs
    pipeline: int = 1  # P: 1 = no pipeline; must divide nproc
    placement: str = "modular"  # modular: stage s on pipeline rank s mod P (the paper's) | contiguous
    schedule: str = "auto"  # auto: breadth_first (modular), 1f1b (contiguous) | interleaved_1f1b | gpipe
    layers_per_stage: int = 1  # transformer layers per stage (modular placement)
    partition_state: bool = False  # each data-parallel rank keeps the optimizer state of its shard only


@dataclass
class EpsConfig:
    """Where the eager param-server (the L2L modes) keeps the training state: ``host`` RAM, or ``disk``:
    one file per layer under ``path`` (unset: ``<run dir>/eps``), with ``host_cache_layers`` layers in RAM
    (the ones about to be used), read ahead and written back behind the compute. The disk state is
    committed after every step, so it is also the run's checkpoint (``trainer.resume``)."""

    tier: str = "host"  # host (RAM) | disk (the L2L modes: one file per layer, a few cached in RAM)
    path: str | None = None  # disk: the directory of the layer files (unset: <run dir>/eps; a fast local SSD)
    host_cache_layers: int = 4  # disk: layers in RAM at once (>= 2; 4: the backward's read serves the update)
    grad_ram_gb: float = 8.0  # disk: gradients kept in RAM (parked, or for a rollback) instead of on disk, GB
    grad_ram_layers: int = 2  # disk: at most this many layers' waiting gradients in RAM (beyond: on disk)
    # disk, global clipping: how a speculative update is redone when the step's norm says clip. keep: each
    # gradient is kept until the verdict (beyond the RAM pool: written, 4 B/param a step); replay: none is
    # kept, a clipped step runs again from its start with the factor known; auto: keep while a recent
    # step's norm came within half of optim.max_grad_norm, else replay
    clip_redo: str = "auto"
    # the host update's threads (0: the device's default: on CUDA every core of this rank's share but one,
    # which the compute thread keeps for launching kernels; on a CPU device half of them)
    threads: int = 0
    # AdamW's host update: native (one pass, a C kernel built with the machine's compiler on first use),
    # torch (torch ops, several passes), auto (native where it builds and equals torch's fused AdamW bit for
    # bit here, else torch)
    update_kernel: str = "auto"


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (``peft=lora``): LoRA adapters on a frozen base. Only the adapters
    (and ``modules_to_save``) are trained; the base crosses the relay without gradient or update, and may
    be held in low precision (``base_dtype``) and read from disk layer by layer (``base_source``)."""

    name: str = "none"  # none | lora (set by the peft group)
    r: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA alpha (the update is scaled by alpha / r)
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: Any = (
        "all-linear"  # the checkpoint's module names (q_proj,v_proj | c_attn | query,...) or all-linear
    )
    modules_to_save: Any = (
        None  # modules trained whole besides the adapters (a BERT classifier: [classifier])
    )
    base_dtype: str = (
        "fp32"  # the frozen base on host/disk: fp32 | bf16 | fp16 | int8 | nf4 (dequantized on the device)
    )
    base_source: str = (
        "host"  # host (RAM) | disk (L2L modes: each frozen layer read from files as it is needed)
    )
    use_rslora: bool = False  # rank-stabilized LoRA (PEFT's): the update scaled by alpha / sqrt(r)
    use_dora: bool = False  # DoRA (PEFT's): a trained magnitude per output channel beside the adapters
    # a saved adapter (PEFT's layout: a run's final/, or anyone's save_pretrained) the run starts from; its
    # adapter_config.json must match r, alpha, use_rslora and target_modules
    init_from: str | None = None
    # the adapters' init: true (PEFT's: lora_A Kaiming-uniform, lora_B zero) | gaussian (lora_A ~ N(0, 1/r))
    init_lora_weights: Any = True
    # true: use the adapter on a model.pretrained whose files differ from the base it was trained on
    # (a resume, eval, predict, generate, export); false refuses that base in one line
    allow_base_change: bool = False
    # base_source=disk: true keeps <eps.path>/frozen_base after a finished run (a resume to more steps or a
    # next run on the same base and eps.path reuses it); a run that stops short always keeps it
    keep_encoded_base: bool = False


@dataclass
class ProfileConfig:
    memory: bool = True  # device-tier memory meter (always on for device=sim: it enforces the budget)
    # device=cpu: count op by op only in the steps that can set a new peak (the first two, and each batch
    # shape no metered step covered); false: every op of every step (slower; device=sim always does)
    memory_sample: bool = True
    sync_timers: bool = False  # CUDA: wait for the compute stream at phase boundaries (copies still overlap)


@dataclass
class HardwareConfig:
    """Hardware model for ``l2l plan`` (see conf/hardware). Defaults: the L2L v1 paper's V100 (§3.1.2).

    Rates are *effective* (what a transformer layer achieves), except ``device_peak_tflops``, which the
    layered-GA analysis uses at perfect efficiency. Optimizer work is counted in the L2L v1 paper's units
    (an update of BERT-Large's ~335M parameters = 100 GFLOP, i.e. 300 FLOP per parameter).
    """

    name: str = "v100-16g"  # the hardware model (set by the hardware group)
    device_tflops: float = 30.0  # effective device throughput for layer matmuls, fp32
    device_tflops_half: float | None = None  # the same under precision=amp|cmp; unset: peak × mfu
    device_peak_tflops: float = 125.0  # half-precision peak (layered-GA: compute time, intensity thresholds)
    # share of device_peak_tflops a training step's counted FLOPs achieve (8 per token and layer parameter,
    # recompute included): the one efficiency every l2l plan view uses (presets cite their source)
    mfu: float = 0.24
    backward_factor: float = 2.0  # backward time / forward time of a layer (the papers: 2)
    device_memory_gb: float = 16.0  # device memory, GiB
    device_reserved_gb: float = 0.0  # device memory beyond the tensors: CUDA context, workspaces, allocator
    attention_bytes_half: float | None = None  # amp/cmp: bytes kept per attention score; unset: HF math (15)
    device_optim_gflops: float = 480.0  # the baselines' on-device update: its arithmetic rate, GFLOP/s
    device_memory_gbps: float = 900.0  # device memory bandwidth, GB/s (the on-device update is bound by it)
    host_gflops: float = 300.0  # EPS (host optimizer) throughput
    host_memory_gb: float = 512.0  # host memory per node, GiB (the ranks on a node share it)
    gpus_per_node: int | None = None  # ranks (GPUs) sharing one node's host memory; unset: node_size
    h2d_gbps: float = 16.0  # host<->device link, GB/s per direction
    network_gbps: float = 12.5  # data-parallel / pipeline network per device, GB/s (input + output)
    p2p_latency_us: float = 10.0  # a message between pipeline ranks: its latency, µs (bytes at network_gbps)
    pipe_action_us: float = 100.0  # a pipeline schedule action (chunk, send, recv) beyond compute, µs
    pipe_wake_us: float = 0.0  # a message's wait for its sender's core while that computes (gloo on CPU), µs
    pipe_link: str = "nccl"  # the transport pipe_action_us and pipe_wake_us describe: nccl | gloo
    tensor_link_gbps: float = 0.0  # tensor-parallel interconnect (NVLink), GB/s (input + output); 0: none
    offload_gbps: float = 32.0  # CPU<->GPU for offloading (layered-GA eq. 13), GB/s (input + output)
    pcie_gbps: float = 31.5  # the GPU's PCIe link, which network and offload share (layered-GA §5), GB/s
    ethernet_gbps: float = 6.25  # plan.network=ethernet: per GPU, GB/s (the paper's 400 Gb/s per 16 GPUs)
    node_size: int = 8  # GPUs joined by the tensor link (plan --search: n_a beyond it uses the network)
    async_copy: bool = True  # copies run beside compute (GPU copy engines, device=sim); false: inline
    disk_read_gbps: float = 3.0  # the disk EPS tier's sequential read, GB/s (a datacenter NVMe drive)
    disk_write_gbps: float = 2.0  # ... and write
    disk_mixed_gbps: float = 0.0  # ... read + write at once, GB/s in all (0: unknown; their times add up)
    disk_free_gb: float = 3500.0  # GiB free for the disk EPS (hardware=measure: the eps.path filesystem's)
    measured: bool = False  # hardware=measure: time this machine and use those numbers instead


@dataclass
class PlanConfig:
    """``l2l plan``: recommendation target, 3d-parallel degrees (layered-GA §5), measurement repeats."""

    max_transfer_overhead: float = 0.10  # bound on L2L's transfer share of the step (L2L v2 eq. 4)
    tensor_parallel: int = 1  # tensor-parallel degree (splits the heads)
    pipeline_parallel: int = 1  # pipeline stages
    data_parallel: int = 1  # data-parallel replicas
    train_steps: int = 100_000  # steps for the layered-GA training-time estimate (the paper's 100k)
    tokens: float = 0.0  # the training budget in tokens (a fine-tune: 100e6); 0: plan.steps or train_steps
    steps: int = 0  # the training budget in optimizer steps of the configured batch; 0: unset
    measure_repeats: int = 5  # hardware=measure: timed repetitions per primitive (the median is used)
    # --search/--scaling: infiniband (hardware.network_gbps) | ethernet (hardware.ethernet_gbps)
    network: str = "infiniband"
    parallelism: str = "all"  # --search: all | none | data | data+pipe | data+tensor | 3d
    method: str = "all"  # --search: all | baseline | partitioned | improved (layered-GA §5)
    max_gpus: int = 0  # --search: at most this many GPUs (0: no limit)
    max_days: float = 0.0  # --search: the fewest GPUs that train within this many days (0: the fastest)
    node_size: int | None = (
        None  # --search/--scaling: GPUs per tensor link; unset: hardware.node_size; 0: no limit
    )
    max_overhead: float = 0.25  # --search: cap on each exposed transfer overhead (the paper's 25%)
    scaling_points: int = 36  # --scaling: X[x] model sizes from 1e9 to 1e16 parameters


@dataclass
class L2LConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    mode: ModeConfig = field(default_factory=ModeConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    eps: EpsConfig = field(default_factory=EpsConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)  # device=auto|cpu|cuda|sim, device.memory_gb
    logger: Any = "auto"  # csv | tensorboard | wandb | none, or several: [csv,wandb]; auto: csv + tensorboard
    scale: str = "cpu"  # recipes/: cpu (minutes on a small CPU) | paper (the papers' sizes); see l2l.pick


def register() -> None:
    """Put the schema in Hydra's ConfigStore; conf/config.yaml names it first in its defaults."""
    ConfigStore.instance().store(name="l2l_schema", node=L2LConfig)


def to_container(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config (for JSON files)."""
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]

"""Checkpoints: written atomically, verified before use, never unpickled.

A checkpoint is a directory ``checkpoints/step_<k>/`` holding
  manifest.json   format, step, mode, state layout, model shape, and every file's size and sha256
                  (crc32 for real-time files, whose checksum is on the per-step CPU budget)
  state.json      the trainer: step, data position, loss scaler, RNG states, counters (plain JSON)
  config.yaml     the resolved config it was written with (for the record)
  *.safetensors   the training state: weights and optimizer moments (the runner's own layout)
It is written into a temporary directory, every file fsynced, then renamed into place, so a crash
leaves either the old set of checkpoints or the new one, never half of one. Loading checks the
manifest (sizes, checksums, file names), the model shape and the state layout before anything is read.

Real-time checkpoints (L2L modes, layered-GA paper §8.2): the EPS already holds the master weights on
the host, so a background writer saves each layer right after its update; a step's files become a
checkpoint (``checkpoints/realtime/step_<k>/``) once all its layers are written, so a SIGKILL loses at
most the step in flight.

The package, one concern a module: ``manifest`` (the manifest, the identity and integrity checks, reading
a file checked), ``io`` (fsynced and streamed writes on the disk tier's aligned buffers, the atomic
directory swap), ``commit`` (writing a checkpoint, an exported directory), ``layout`` (the module layout
by Hugging Face name), ``rng`` (RNG states), ``discovery`` (finding, pruning, cleaning up),
``realtime`` (the real-time writer) and ``fingerprint`` (the files of the base a LoRA adapter needs, by
size and hash). The names below are its public interface.
"""

from l2l_cli.checkpoint.commit import DIR_CHECKSUMS, Written, save, save_dir, shard_dir, verify_dir
from l2l_cli.checkpoint.discovery import (
    candidates,
    find_latest_run,
    latest_valid,
    prune,
    remove_stale,
    run_dir_of_checkpoint,
)
from l2l_cli.checkpoint.fingerprint import FINGERPRINT_FILE, fingerprint, recorded
from l2l_cli.checkpoint.io import recover_dir, replace_dir, tensors_bytes, write_bytes, write_tensors
from l2l_cli.checkpoint.layout import MOMENTS_FILE, WEIGHTS_FILE, ModuleState, module_state_files
from l2l_cli.checkpoint.manifest import (
    FORMAT,
    BaseChanged,
    CheckpointError,
    check_base,
    check_identity,
    identity,
    read_checked,
    read_tensors,
    verify,
    verify_manifest,
)
from l2l_cli.checkpoint.realtime import RealtimeWriter
from l2l_cli.checkpoint.rng import rank_rng, rng_state, set_rng_state

__all__ = [
    "DIR_CHECKSUMS",
    "FINGERPRINT_FILE",
    "FORMAT",
    "MOMENTS_FILE",
    "WEIGHTS_FILE",
    "BaseChanged",
    "CheckpointError",
    "ModuleState",
    "RealtimeWriter",
    "Written",
    "candidates",
    "check_base",
    "check_identity",
    "find_latest_run",
    "fingerprint",
    "identity",
    "latest_valid",
    "module_state_files",
    "prune",
    "rank_rng",
    "read_checked",
    "read_tensors",
    "recorded",
    "recover_dir",
    "remove_stale",
    "replace_dir",
    "rng_state",
    "run_dir_of_checkpoint",
    "save",
    "save_dir",
    "set_rng_state",
    "shard_dir",
    "tensors_bytes",
    "verify",
    "verify_dir",
    "verify_manifest",
    "write_bytes",
    "write_tensors",
]

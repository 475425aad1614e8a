"""Ending one worker's run after its last step (`finish`): the export, the parts' last work (the final task
evaluation) and the sample on one unsharded copy of the model, the last checkpoint completed, and the results for
the run record."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import config as config_lib
from ..common.exports import export_is_valid
from .evaluation.generate import generate_sample
from .evaluation.heldout import evaluate, heldout_batches, synthetic_heldout
from .metrics import format_timeline
from .model import export
from .model.lora import adapter_state_dict
from .parts import LoopState
from .trainer import Trainer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def export_due(cfg: config_lib.RunConfig, run_dir: str) -> bool:
    """Whether this run ends with an export (not when a finished run is re-run and its export is accepted)."""
    return cfg.checkpoint.export and not export_is_valid(run_dir, cfg.train.max_steps)


def finish(trainer: Trainer, state: LoopState, exporting: bool, acceptance: export.AcceptanceProcess | None) -> dict:
    """After the last step, on one unsharded copy of the model (gathered on first need): the export, written first
    and checked in its own process while the final task evaluation and the sample run here, all beside the last
    checkpoint's write; that checkpoint is completed before the export's verdict is collected (last without an
    export or when it fails), always before success. Returns the results for the run record."""
    worker, cfg = trainer.worker, trainer.worker.cfg
    accepted = None
    copies: list[PreTrainedModel] = []

    def copy() -> PreTrainedModel:
        if not copies:
            with worker.timeline.phase("checkpoint"):
                trainer.checkpointer.wait_device_copy()  # the model's copy and the decoding may need its room
            with worker.timeline.phase("export"):
                copies.append(trainer.unsharded_copy())
        return copies[0]

    try:
        pending = None
        if exporting:  # written now and checked in the acceptance process while the task evaluation runs
            lm = copy()
            with worker.timeline.phase("export"):
                pending = start_export(trainer, state, lm, acceptance)
        for part in trainer.parts:
            part.finish(state, copy)
        if cfg.eval.sample_prompt is not None:
            text = generate_sample(copy(), trainer.tokenizer, cfg.eval.sample_prompt, cfg.eval.sample_tokens,
                                   worker.device)
            worker.log({"kind": "sample", "step": cfg.train.max_steps, "prompt": cfg.eval.sample_prompt, "text": text})
        if exporting:
            # Completing the last save (and pruning, seconds for 19 GB) overlaps the export's check, in its process.
            with worker.timeline.phase("checkpoint"):
                trainer.checkpointing.complete(state)
            with worker.timeline.phase("export"):
                accepted = finish_export(trainer, state, pending, acceptance)
        copies.clear()
    finally:
        with worker.timeline.phase("checkpoint"):
            trainer.checkpointing.complete(state)
    time_summary = worker.timeline.summary()
    worker.log({"kind": "time", "step": cfg.train.max_steps, **time_summary})
    if worker.logger:
        print(format_timeline(time_summary), flush=True)
        worker.logger.close()
    results = {"checkpoints": {"dir": worker.run_dir, "latest": state.latest_checkpoint,
                               "keep_last": cfg.checkpoint.keep_last},
               "time": time_summary, "weights": trainer.weights()}
    if accepted is not None:
        results["export"] = accepted
    if cfg.eval.task:
        results["evaluation"] = state.task_results
    return results


def start_export(trainer: Trainer, state: LoopState, lm: PreTrainedModel,
                 acceptance: export.AcceptanceProcess | None) -> dict | None:
    """Write the final model's export and start its check against the final held-out loss (measured here when the
    loop did not, on seeded random blocks without a held-out split)."""
    worker, cfg = trainer.worker, trainer.worker.cfg
    heldout, kind = trainer.dataset.validation, "validation"
    if heldout is None:
        heldout, kind = synthetic_heldout(lm.config.vocab_size, 2 * worker.world * cfg.train.micro_batch_size,
                                          cfg.train.seq_len, cfg.train.seed), "synthetic"
    if state.final_eval is None or kind == "synthetic":
        state.final_eval = evaluate(trainer.model, heldout, cfg, worker.rank, worker.world, worker.device)
    reference = {"eval_loss": state.final_eval, "step": cfg.train.max_steps, "world_size": worker.world,
                 "heldout": kind}
    batches = heldout_batches(len(heldout), worker.world, cfg.train.micro_batch_size, cfg.eval.max_batches)
    adapters = adapter_state_dict(trainer.model.lm) if cfg.model.lora.rank else None  # collective when sharded
    return export.start_export(lm, trainer.tokenizer, cfg, worker.run_dir, reference, heldout, batches, acceptance,
                               adapters)


def finish_export(trainer: Trainer, state: LoopState, pending: dict | None,
                  acceptance: export.AcceptanceProcess | None) -> dict:
    """The verdict on the export `start_export` began (collective), logged."""
    accepted = export.finish_export(pending, acceptance)
    trainer.worker.log({"kind": "export", "step": trainer.worker.cfg.train.max_steps, "dir": accepted["export_dir"],
                        "eval_loss": accepted["eval_loss"], "reference_eval_loss": state.final_eval,
                        "abs_diff": accepted["abs_diff"], "generation": accepted["generation"]["text"],
                        "timings": accepted["timings"]})
    return accepted

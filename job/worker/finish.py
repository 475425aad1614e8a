"""Ending one worker's run after its last step (`finish`): the export, the final task evaluation and sample on
one unsharded copy of the model, the last checkpoint completed, and the results for the run record."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from . import export as export_lib
from .evaluate import evaluate, generate_sample, heldout_batches, synthetic_heldout
from .metrics import format_timeline
from .model import adapter_state_dict
from .run import Run, complete_checkpoint, unsharded_copy
from .task_eval import run_task_eval

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def finish(run: Run, weights: Callable[[], dict], exporting: bool,
           acceptance: export_lib.AcceptanceProcess | None) -> dict:
    """After the last step, on one unsharded copy of the model: the export (when `exporting`), written first and
    checked in its own process (`acceptance`, rank 0's) while the final task evaluation and the sample run here,
    all while the last checkpoint's write goes on; that checkpoint is completed before the export's verdict is
    collected, or last when there is no export or it fails, and always before the job reports success. Returns
    the results for the run record."""
    cfg = run.cfg
    accepted = None
    try:
        task_due = cfg.eval.task and run.start_step < cfg.train.max_steps  # a re-run of a finished run has it
        lm = pending = None
        if task_due or exporting or cfg.eval.sample_prompt is not None:
            with run.timeline.phase("checkpoint"):
                run.checkpointer.wait_device_copy()  # the model's copy and the decoding may need its room
            with run.timeline.phase("export"):
                lm = unsharded_copy(run)
                if exporting:  # written now and checked in the acceptance process while the task evaluation runs
                    pending = start_export(run, lm, acceptance)
        if task_due:
            run_task_eval(run, cfg.train.max_steps, lm)
        if cfg.eval.sample_prompt is not None:
            text = generate_sample(lm, run.tokenizer, cfg.eval.sample_prompt, cfg.eval.sample_tokens, run.device)
            run.log({"kind": "sample", "step": cfg.train.max_steps, "prompt": cfg.eval.sample_prompt, "text": text})
        if exporting:
            # The last save's write is usually done by now: completing it (and pruning the checkpoint it
            # replaces, seconds for 19 GB) overlaps the export's check, which goes on in its own process.
            with run.timeline.phase("checkpoint"):
                complete_checkpoint(run)
            with run.timeline.phase("export"):
                accepted = finish_export(run, pending, acceptance)
        del lm
    finally:
        with run.timeline.phase("checkpoint"):
            complete_checkpoint(run)
    time_summary = run.timeline.summary()
    run.log({"kind": "time", "step": cfg.train.max_steps, **time_summary})
    if run.logger:
        print(format_timeline(time_summary), flush=True)
        run.logger.close()
    results = {"checkpoints": {"dir": run.run_dir, "latest": run.latest_checkpoint, "keep_last": cfg.checkpoint.keep_last},
               "time": time_summary, "weights": weights()}
    if accepted is not None:
        results["export"] = accepted
    if cfg.eval.task:
        results["evaluation"] = run.task_results
    return results


def start_export(run: Run, lm: PreTrainedModel, acceptance: export_lib.AcceptanceProcess | None) -> dict | None:
    """Writes the export of the final model and starts its check (`export.start_export`) against the final
    held-out loss (measured here when the loop did not, e.g. a finished run re-run, or on seeded random blocks
    for runs without a held-out split)."""
    cfg = run.cfg
    heldout, kind = run.dataset.validation, "validation"
    if heldout is None:
        heldout, kind = synthetic_heldout(lm.config.vocab_size, 2 * run.world * cfg.train.micro_batch_size,
                                          cfg.train.seq_len, cfg.train.seed), "synthetic"
    if run.final_eval is None or kind == "synthetic":
        run.final_eval = evaluate(run.model, heldout, cfg, run.rank, run.world, run.device)
    reference = {"eval_loss": run.final_eval, "step": cfg.train.max_steps, "world_size": run.world, "heldout": kind}
    batches = heldout_batches(len(heldout), run.world, cfg.train.micro_batch_size, cfg.eval.max_batches)
    adapters = adapter_state_dict(run.model.lm) if cfg.model.lora.rank else None  # collective when sharded
    return export_lib.start_export(lm, run.tokenizer, cfg, run.run_dir, reference, heldout, batches, acceptance,
                                   adapters)


def finish_export(run: Run, pending: dict | None, acceptance: export_lib.AcceptanceProcess | None) -> dict:
    """The verdict on the export `start_export` began (collective), logged."""
    accepted = export_lib.finish_export(pending, acceptance)
    run.log({"kind": "export", "step": run.cfg.train.max_steps, "dir": accepted["export_dir"],
             "eval_loss": accepted["eval_loss"], "reference_eval_loss": run.final_eval,
             "abs_diff": accepted["abs_diff"], "generation": accepted["generation"]["text"],
             "timings": accepted["timings"]})
    return accepted

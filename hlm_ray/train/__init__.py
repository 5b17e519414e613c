"""Training: one worker's loop, and Ray Train around it.

loop.py            `train_worker`: when to step, log, validate, checkpoint and stop
setup.py           the run built (tokenizer, corpus, model, objective, optimizer), resume
run_state.py       WorkerEnv, LocalReporter, TrainRun (what a worker holds while it trains)
step.py            one optimizer step (micro-batches, clip, update)
log_window.py      the train/* metrics of the steps since the last log line
validate.py        the held-out slice scored by the run's objective
run_checkpoints.py the step's checkpoint, the best one, the final model; restore
token_counts.py    the target tokens the run trains on, counted; what the model folder gets
run_tracking.py    the run's tracker, tags and artifacts
finish.py          the run's summary and what a budget became
lm_objective.py    model + objective as one module whose forward returns the loss
inputs.py          the tokenizer and token blocks of the prepared data; micro-batches, masking
optim.py           AdamW (dense or lazy embedding update), schedules, clipping
compile.py         torch.compile of the objective or the CWT loss
distributed.py     the collectives (cross-worker negatives, global means)
checkpoint.py      the checkpoint folder format: manifest, atomic writes, verify, prune
resume.py          resuming a run folder with the config it was trained with
launch.py          Ray Train: TorchTrainer, failures, the MLflow run
interrupt.py       Ctrl-C on a local or Ray run
summary.py         the printed run table and loss curves
"""

"""The lmms-eval plugin: `lmms-eval eval --model mmadapt --model_args pretrained=DIR --tasks TASKS`.

lmms-eval 0.7 finds outside models through the entry-point group `lmms_eval.models`: mmadapt's entry point `mmadapt`
(pyproject.toml) is `mmadapt.lmms_eval.plugin:MANIFEST`, a `ModelManifest` naming `MmadaptModel` (in the same
module) as the chat implementation of `--model mmadapt`. Installed with the optional extra: `pip install
'mmadapt[lmms]'`.

The package holds everything mmadapt does with lmms-eval: `model` (`LmmsChatModel`: lmms-eval's chat model over a
model in memory, answering by `mmadapt.answering`), `plugin` (`MmadaptModel`: the same over a model loaded from disk)
and `tasks` (a training run's `train.eval_tasks`: `check_eval_tasks`, `evaluate_tasks`; the trainer imports it only
when they are set). The package's own module imports nothing: its modules sit in two layers (`model` and `tasks` below
training, which calls them; `plugin` above inference, whose loading it uses), and importing `model` or `tasks`
imports nothing of lmms-eval's model registry (the plugin builds `MANIFEST` when first asked for).

`MmadaptModel` loads `pretrained` as `mmadapt chat` does (`load_for_inference`: a model directory, a run, a
checkpoint, a run's adapters directory, or a base model with `adapters=DIR`) and answers lmms-eval's chat requests
with `mmadapt.lmms_eval.model.LmmsChatModel` (the model's own chat template and processor, batched generation, the
task's decoding settings; its `record` says what decides the scores). Its `--model_args`:

    pretrained=DIR        the model (required); adapters=DIR: LoRA adapters merged into it
    device=cuda:0         default: the CUDA device of LOCAL_RANK when there is one, else the CPU
    max_new_tokens=256    when a task sets none
    system_prompt=TEXT    the system message of requests whose task gives none (a file path: its text)
    seed=0                for tasks that sample without a seed
    chat_template=auto    auto (the model's own), tokenizer, or a built-in name (mmadapt list)
    template_kwargs=JSON  e.g. '{"enable_thinking": false}'
    max_length=2048       tokens per prompt, image and video tokens included
    record=PATH           write the record (what decides the scores) there as JSON after generating

and lmms-eval's own `--batch_size N` (requests generated together; an integer). `MmadaptModel.from_model(model,
tokenizer)` is the same chat model over a model in memory (`LmmsChatModel.from_model`), for
`lmms_eval.evaluator.simple_evaluate(model=...)` in a notebook or a training loop.
"""

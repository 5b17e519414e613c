"""`hlm generate`: print a prompt and a sample from a decoder, streamed as it is decoded.

hlm generate --model runs/tiny-headless-clm "The cat" --max-tokens 20 --seed 3
"""

from __future__ import annotations

import sys

from hlm_ray.commands.common import add_command, device_arg, readout_arg


def add_parsers(sub) -> None:
    gen = add_command(sub, "generate", cmd_generate)
    gen.add_argument("prompt", help="the text to continue")
    gen.add_argument("--model", required=True, help="run/checkpoint/model folder or models:/")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (32)")
    gen.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (1.0)"
    )
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    gen.add_argument("--seed", type=int, help="sampling seed: the same seed, the same text")
    gen.add_argument(
        "--allow-raw-head",
        action="store_true",
        help="generate from a headless decoder that was never fine-tuned with its raw Eᵀ head "
        "when it has no prior readout (no token counts)",
    )
    readout_arg(gen)
    device_arg(gen)


def cmd_generate(args) -> int:
    """print a sample from a decoder (run, checkpoint or models:/ URI)

    Load a decoder (a vanilla run, a headless one through its prior readout, or one fine-tuned
    with `hlm finetune --task clm`) and print the prompt and a sample, streamed as it is
    decoded."""
    from hlm_ray.pretrained import REGISTRY_SCHEME, resolve_model_dir

    _check_prompt(args.prompt)
    if not args.model.startswith(REGISTRY_SCHEME):
        resolve_model_dir(args.model)  # a mistyped folder is answered before torch is imported
    from hlm_ray.generate.params import SamplingParams  # (hlm_ray.generate imports torch)

    # Bad sampling settings are answered before the model loads and the prompt is echoed.
    SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    from hlm_ray.generate import Generator

    generator = Generator.load(
        args.model, device=args.device, allow_raw_head=args.allow_raw_head, readout=args.readout
    )
    print(args.prompt, end="", flush=True)
    finish = None
    for delta in generator.stream(
        args.prompt,
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    ):
        print(delta.text, end="", flush=True)
        finish = delta.finish_reason or finish
    print()
    readout = generator.info.get("readout") or "head"
    print(f"[{generator.name}: readout={readout}, finish_reason={finish}]", file=sys.stderr)
    return 0


def _check_prompt(prompt: str) -> None:
    """A prompt from a command line that is not UTF-8 (bytes Python kept as surrogates, such as
    `$'\\xff\\xfe'`): one line, not a traceback from the tokenizer or the echo."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        from hlm_ray.errors import HLMError

        code = ord(prompt[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise HLMError(
            f"the prompt is not UTF-8 text ({what} at character {err.start}); pass it in "
            "UTF-8 (iconv -t utf-8 converts a file)"
        ) from None

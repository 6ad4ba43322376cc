"""`FRAMEWORKS`, every stack's profile by name in the order ``--framework`` lists them, and
`framework_profile`, which reads a ``NAME[:option=value,...]`` spec into a profile."""

from __future__ import annotations

import dataclasses

from cost_model.frameworks.autoplan_runtime import AUTOPLAN
from cost_model.frameworks.deepspeed import DEEPSPEED
from cost_model.frameworks.flash_attn_training import FLASH_ATTN_TRAINING
from cost_model.frameworks.llm_foundry import LLM_FOUNDRY
from cost_model.frameworks.megatron import (
    MEGATRON_DEEPSPEED,
    MEGATRON_LM,
    MEGATRON_LM_2019,
    MEGATRON_LM_2021,
)
from cost_model.frameworks.nanotron import NANOTRON
from cost_model.frameworks.profile import (
    DEFAULT_FRAMEWORK,
    FrameworkError,
    FrameworkProfile,
    OptionValue,
)
from cost_model.frameworks.torchtitan import TORCHTITAN
from cost_model.messages import shown

FRAMEWORKS: dict[str, FrameworkProfile] = {
    profile.name: profile
    for profile in (
        AUTOPLAN,
        MEGATRON_LM,
        NANOTRON,
        MEGATRON_LM_2021,
        MEGATRON_LM_2019,
        MEGATRON_DEEPSPEED,
        DEEPSPEED,
        TORCHTITAN,
        LLM_FOUNDRY,
        FLASH_ATTN_TRAINING,
    )
}


def framework_profile(spec: str) -> FrameworkProfile:
    """The profile ``NAME[:option=value,...]`` names (``megatron-lm-2021:ddp=torch``), named by
    the spec in its normal form (spaces and empty options dropped: ``megatron-lm:`` is
    ``megatron-lm``); `FrameworkError` lists the known names, or the options the profile has."""
    name, _, rest = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    name = name.strip()
    if not isinstance(spec, str) or name not in FRAMEWORKS:
        raise FrameworkError(
            f"unknown framework {shown(spec)}; use one of {', '.join(FRAMEWORKS)} "
            f"(default {DEFAULT_FRAMEWORK})"
        )
    profile = FRAMEWORKS[name]
    changes: dict[str, OptionValue] = {}
    given: list[str] = []
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, _, value = (part.strip() for part in item.partition("="))
        choices = profile.options.get(key, {})
        if value not in choices:
            known = "; ".join(
                f"{option}={'|'.join(values)}" for option, values in profile.options.items()
            )
            raise FrameworkError(
                f"framework {shown(spec)}: {name} has no option {shown(item)}; "
                + (f"its options: {known}" if known else "it takes no options")
            )
        earlier = next((g for g in given if g.partition("=")[0] == key), None)
        if earlier is not None:
            raise FrameworkError(
                f"framework {shown(spec)}: option {shown(key)} is given twice ({earlier}, "
                f"{key}={value}); give it once"
            )
        changes.update(choices[value])
        given.append(f"{key}={value}")
    if not given:
        return profile
    return dataclasses.replace(profile, name=f"{name}:{','.join(given)}", **changes)  # type: ignore[arg-type]

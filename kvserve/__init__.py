"""kvserve: a small, readable LLM serving engine.

The public Python API is ``LLM``, ``SamplingParams`` and ``GuidedSpec`` (structured output);
see ``kvserve.llm``.
"""

from kvserve.engine.request import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "GuidedSpec", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import kvserve` stays cheap for the CLI and tools.
    if name == "LLM":
        from kvserve.llm import LLM

        return LLM
    if name == "GuidedSpec":
        from kvserve.structured.spec import GuidedSpec

        return GuidedSpec
    raise AttributeError(name)

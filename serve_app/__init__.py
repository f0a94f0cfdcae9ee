"""SLO-aware LLM serving on Ray Serve and vLLM."""

__version__ = "0.1.0"

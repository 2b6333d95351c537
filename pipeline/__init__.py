"""Pipeline parallel: splitting a model into stages, placing them on ranks, schedules, the runner.

    from pipeline import pipeline_decoder       # a ModelSpec.pipelining_fn
    pipelined = pipeline_decoder(meta_model, parallel_dims=dims, options=options, pipeline=PipelineOptions(...),
                                 parallelize_fn=parallelize_fn, device=device)
    pipelined.train_step(microbatches, loss_fn)  # forward + backward of every microbatch
    pipelined.forward_step(microbatches, fn)     # forward only

Modules: ``split`` (stages by module names), ``placement`` (stage -> rank, loop and V),
``schedules`` (schedule by name, microbatch and AC rules), ``runner`` (one pipelined step),
``p2p`` (the forward-only pass's transfer order and transport),
``model`` (this rank's stages and what the engine asks of them).
"""

from pipeline.model import PipelinedModel, PipelineOptions, PipeliningFn, pipeline_decoder
from pipeline.runner import Microbatch
from pipeline.split import PipelineConfigError

__all__ = ["Microbatch", "PipelineConfigError", "PipelineOptions", "PipelinedModel", "PipeliningFn", "pipeline_decoder"]

"""Pipeline parallelism: schedules as pure data (:mod:`paratrain.pipeline.schedules`)."""

"""Model-parallel applications over the scheduling engines (:mod:`paratrain.sched`): their problems, the job
each rank of ``paratrain sched`` runs, the single-process anchors they are measured against, and their figures."""

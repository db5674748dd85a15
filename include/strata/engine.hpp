// Compatibility include: the Trainer's header is strata/trainer.hpp and the training vocabulary
// (TrainerConfig, LrSchedule, StepMetrics, EvalResult) strata/training.hpp. Programs written
// against earlier releases include this name; new code includes those.
#pragma once

#include "strata/trainer.hpp"

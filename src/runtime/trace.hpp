// The engine's tracer lives with the engine (src/offload/trace.hpp); this name stays for the code
// and tests that include it from here.
#pragma once

#include "offload/trace.hpp"

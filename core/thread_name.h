// thread_name.h: names the calling thread for the tools that show threads
// (top -H, ps -L, perf, gdb), so the engine's, the batchers' and the answer
// threads can be told apart from gRPC's when a profile is read.
#pragma once

#include <string_view>

namespace attention {

// The kernel keeps 15 bytes of a thread's name; a longer `name` is cut there.
void NameCurrentThread(std::string_view name);

}  // namespace attention

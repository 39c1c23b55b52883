// thread_name.cc: NameCurrentThread over pthread_setname_np (thread_name.h).
#include "core/thread_name.h"

#include <pthread.h>

#include <algorithm>
#include <string>

namespace attention {

void NameCurrentThread(std::string_view name) {
  constexpr size_t kMaxLength = 15;  // TASK_COMM_LEN - 1
  const std::string cut(name.substr(0, std::min(name.size(), kMaxLength)));
  pthread_setname_np(pthread_self(), cut.c_str());
}

}  // namespace attention

// raw_service.h: a gRPC service with the methods named registered raw.
//
// gRPC's generated code makes a method raw by wrapping the service in its
// WithRawCallbackMethod_<Method> template, once per method, so a service with
// many methods is a deep nest of wrappers. RawCallbackService writes that nest
// from a flat list:
//
//   using Wire = RawCallbackService<Svc::Service, Svc::WithRawCallbackMethod_A,
//                                   Svc::WithRawCallbackMethod_B>;
//   // is Svc::WithRawCallbackMethod_A<Svc::WithRawCallbackMethod_B<Svc::Service>>
#pragma once

namespace attention::server {
namespace raw_service_internal {

template <typename Base, template <typename> class... Methods>
struct Wrap {
  using type = Base;
};

template <typename Base, template <typename> class First, template <typename> class... Rest>
struct Wrap<Base, First, Rest...> {
  using type = First<typename Wrap<Base, Rest...>::type>;
};

}  // namespace raw_service_internal

// `Base` (a generated Service) with every method in `Methods` raw.
template <typename Base, template <typename> class... Methods>
using RawCallbackService = typename raw_service_internal::Wrap<Base, Methods...>::type;

}  // namespace attention::server

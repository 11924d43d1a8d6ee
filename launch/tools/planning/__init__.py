"""Planning a job: ``plan`` (which layouts fit, best first: ``python -m launch.plan``) over ``layout_price``
(a layout's bytes and transfers) and ``link_model`` (a step's time on given links)."""

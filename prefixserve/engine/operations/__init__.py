"""Operations on a running engine, beside the requests' life: hot reloads, operator pins, calibration."""
